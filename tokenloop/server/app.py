"""The OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from tokenloop.engine.async_engine import AsyncEngine, RequestFailed
from tokenloop.engine.beam_search import BeamSearchParams
from tokenloop.outputs import CompletionOutput, RequestOutput
from tokenloop.sampling.params import SamplingParams
from tokenloop.server.body_limit import DEFAULT_MAX_BODY_MB, LimitBody
from tokenloop.server.errors import (
    ERROR_RESPONSES,
    APIError,
    CatchAll,
    ErrorShapes,
    error_body,
    install_error_handlers,
    param_of,
)
from tokenloop.server.generation import Generation, sse, until_disconnected
from tokenloop.server.input_work import CountInputWork
from tokenloop.server.protocol import ChatCompletionRequest, CompletionRequest
from tokenloop.server.responses import (
    ChoiceIndexer,
    ChoiceProgress,
    ToolCallStream,
    Usage,
    chat_logprobs,
    chat_message,
    completion_logprobs,
    join_logprobs,
    legacy_logprobs,
    prompt_logprobs,
)
from tokenloop.server.tokenize import add_tokenizer_routes
from tokenloop.strategies.self_consistency import AnswerSpec, VoteCounter

DEFAULT_MAX_N = 128  # OpenAI's own bound on n


class Health(BaseModel):
    status: str  # "ok", "stalled" (the step loop is stuck or dead) or "draining" (shutting down)


_GENERATION_RESPONSES = ERROR_RESPONSES | {
    200: {
        "description": "the completion, or with stream: true a stream of server-sent events",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "text/event-stream": {
                "schema": {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}
            },
        },
    },
}


class _RequireAPIKey:
    """401 on /v1 routes without 'Authorization: Bearer KEY' or 'x-api-key: KEY' (Anthropic's header). Plain ASGI
    on purpose: under Starlette's BaseHTTPMiddleware (@app.middleware) Request.is_disconnected() never turns true,
    so a non-streamed request whose client left would run to its end."""

    def __init__(self, app, api_key: str, shapes: ErrorShapes) -> None:
        self.app, self.bearer, self.key, self.shapes = app, f"Bearer {api_key}".encode(), api_key.encode(), shapes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            headers = dict(scope["headers"])
            if headers.get(b"authorization") != self.bearer and headers.get(b"x-api-key") != self.key:
                await self.shapes.response(scope["path"], 401, "invalid or missing API key")(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(
    engine: AsyncEngine,
    model_name: str,
    api_key: str | None = None,
    max_n: int = DEFAULT_MAX_N,
    max_body_mb: float = DEFAULT_MAX_BODY_MB,
) -> FastAPI:
    app = FastAPI(title="tokenloop", docs_url=None, redoc_url=None)
    generation = Generation(engine, model_name)
    inputs = engine.inputs  # prompts are processed on the engine's input threads (engine.input_threads)
    max_model_len = inputs.max_model_len
    shapes = ErrorShapes()
    install_error_handlers(app, shapes)
    if api_key is not None:
        app.add_middleware(_RequireAPIKey, api_key=api_key, shapes=shapes)
    app.add_middleware(LimitBody, max_bytes=int(max_body_mb * 2**20), shapes=shapes)
    app.add_middleware(CountInputWork, work=engine.input_threads)
    app.add_middleware(CatchAll, shapes=shapes)  # added last: outermost, it also covers the key check and body limit
    context = (max_model_len - 1, f"the context is {max_model_len} tokens, the prompt at least one")
    bounds = {
        "n": (max_n, "the server's --max-n"),
        "best_of": (max_n, "the server's --max-n"),
        "max_tokens": context,
        "max_completion_tokens": context,
    }
    app.openapi = lambda: _openapi(
        app, {name: bound for name, (bound, _) in bounds.items()}, max_model_len, inputs.vocab_size
    )

    @app.get("/health", response_model=Health, responses={503: {"model": Health, "description": "stalled or draining"}})
    async def health() -> JSONResponse:
        """200 while the step loop is alive and making progress; 503 when it is stuck or dead, or the server drains."""
        status = "draining" if engine.draining else "ok" if engine.healthy() else "stalled"
        return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
    )
    async def metrics() -> Response:
        """Prometheus metrics in the text exposition format."""
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", responses=ERROR_RESPONSES)
    async def models() -> dict:
        card = {
            "id": model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "tokenloop",
            "max_model_len": max_model_len,
        }
        return {"object": "list", "data": [card]}

    check_model = generation.check_model
    add_tokenizer_routes(app, engine, check_model)

    def meta_of(prefix: str, kind: str) -> dict:
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()), "model": model_name}

    def check_bounds(body: CompletionRequest | ChatCompletionRequest) -> None:
        """The bounds that depend on this server (the schema states them too)."""
        for name, (bound, why) in bounds.items():
            if (value := getattr(body, name, None)) is not None and value > bound:
                raise APIError(400, f"{name} must be at most {bound} ({why}), got {value}", name)
        if getattr(body, "best_of", None) is not None and body.best_of < body.n:
            raise APIError(400, f"best_of must be at least n ({body.n}), got {body.best_of}", "best_of")

    async def start_streams(
        prompts: list, params: SamplingParams | BeamSearchParams, body: CompletionRequest | ChatCompletionRequest
    ) -> list[AsyncIterator[RequestOutput]]:
        # a bad schema is named as the client sent it
        renamed = {"structured_outputs.json": "response_format.json_schema.schema"} if body.response_format else None
        return await generation.start(prompts, params, renamed)

    @app.post("/v1/completions", responses=_GENERATION_RESPONSES)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        check_bounds(body)
        # best_of > n: that many completions run, and the n with the highest cumulative logprob are returned.
        best_of = body.best_of or body.n
        logprobs = 0 if best_of > body.n and body.logprobs is None else body.logprobs  # to rank them
        # echo with logprobs returns the prompt's tokens' logprobs too, as OpenAI's legacy API did
        echo_logprobs = body.logprobs if body.echo else None
        beams = _params(body.beam_search_params)  # best_of (or n) beams, the n best returned
        params = beams or _params(
            lambda: body.sampling_params(body.max_tokens, logprobs, n=best_of, prompt_logprobs=echo_logprobs)
        )
        vote = _params(body.answer_spec)
        if vote is not None:
            if len(body.prompts()) != 1:
                raise APIError(400, "self_consistency takes one prompt", "prompt")
            params = vote.params(params, body.n)
        streams = await start_streams(body.prompts(), params, body)
        if vote is not None:
            return await _voted(
                request,
                streams[0],
                vote,
                body.n,
                meta_of("cmpl", "text_completion"),
                lambda c: {
                    "index": 0,
                    "text": c.text,
                    "logprobs": None,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                },
            )
        if best_of > body.n and beams is None:  # the best are known only at the end: a stream gets them then
            streams = [_best_of(s, body.n) for s in streams]
        meta = meta_of("cmpl", "text_completion")

        tokenizer = inputs.tokenizer

        def echoed(out: RequestOutput) -> tuple[str, dict | None]:
            """What echo puts before the completion: the prompt's text (token-id prompts have none of their
            own: decoded) and, with logprobs, its tokens' logprobs in the legacy format."""
            if not body.echo:
                return "", None
            text = out.prompt if out.prompt is not None else tokenizer.decode(out.prompt_token_ids)
            if body.logprobs is None:
                return text, None
            first = tokenizer.decode(
                out.prompt_token_ids[:1], skip_special_tokens=True
            )  # a BOS is not in the echoed text
            return text, legacy_logprobs(out.prompt_token_ids, out.prompt_logprobs, body.logprobs, 0, first)

        if body.stream:
            return sse(_completion_chunks(streams, params, body, meta, echoed), error_body)
        outs = await generation.collect(request, streams)
        usage, choices = Usage(), []
        for i, out in enumerate(outs):
            usage.add(out)
            echo, echo_logprobs = echoed(out)
            for c in out.outputs:
                logprobs = completion_logprobs(c, 0, body.logprobs, len(echo)) if body.logprobs is not None else None
                if echo_logprobs is not None:
                    logprobs = join_logprobs(echo_logprobs, logprobs)
                choices.append(
                    {
                        "index": i * body.n + c.index,
                        "text": echo + c.text,
                        "logprobs": logprobs,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                    | _prompt_logprobs_field(body, out)
                )
        return JSONResponse(meta | {"choices": choices, "usage": usage.as_dict()})

    @app.post("/v1/chat/completions", responses=_GENERATION_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        check_bounds(body)
        params = _params(lambda: body.sampling_params(body.effective_max_tokens(), body.effective_logprobs()))
        tools = _params(body.tool_calling)
        messages = [m.as_template_message() for m in body.messages]
        prompt = await generation.chat_prompt(messages, tools, body.add_generation_prompt, body.continue_final_message)
        vote = _params(body.answer_spec)
        if vote is not None:
            params = vote.params(params, body.n)
        streams = await start_streams([prompt], params, body)
        meta = meta_of("chatcmpl", "chat.completion")
        if vote is not None:
            return await _voted(
                request,
                streams[0],
                vote,
                body.n,
                meta,
                lambda c: {
                    "index": 0,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": None,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                },
            )
        may_call_tools = tools is not None and tools.constrained
        if body.stream:
            return sse(
                _chat_chunks(streams[0], params, body, meta | {"object": "chat.completion.chunk"}, may_call_tools),
                error_body,
            )
        (out,) = await generation.collect(request, streams)
        usage = Usage()
        usage.add(out)
        choices = []
        for c in out.outputs:
            message, finish_reason = chat_message(c, may_call_tools)
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": chat_logprobs(c, 0, params.logprobs) if params.logprobs is not None else None,
                    "finish_reason": finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
        return JSONResponse(meta | {"choices": choices, "usage": usage.as_dict()} | _prompt_logprobs_field(body, out))

    return app


async def _voted(
    request: Request, stream: AsyncIterator[RequestOutput], spec: AnswerSpec, n: int, meta: dict, choice_of
) -> JSONResponse:
    """Self-consistency: count the samples' answers as they finish; once the leader cannot be overtaken, leave
    the stream (which aborts the samples still running). The reply's one choice is the first winning sample."""
    counter = VoteCounter(spec, n)

    async def count() -> RequestOutput:
        out = None
        try:
            async for out in stream:
                if counter.update(out):
                    break
        except RequestFailed as e:
            raise APIError(500, f"the engine failed this request: {e}") from None
        finally:
            await stream.aclose()
        return out

    last = await until_disconnected(request, count())
    result = counter.result()
    usage = Usage()
    usage.add(last)
    pick = result.winner or (result.samples[0] if result.samples else None)  # no sample answered: the first one
    choices = [choice_of(pick)] if pick is not None else []
    votes = {
        "answer": result.answer,
        "votes": result.votes,
        "confidence": result.confidence,
        "samples": len(result.samples),
        "stopped_early": result.stopped_early,
    }
    return JSONResponse(meta | {"choices": choices, "usage": usage.as_dict(), "self_consistency": votes})


def _params(make) -> SamplingParams:
    try:
        return make()
    except ValueError as e:
        raise APIError(400, str(e), param_of(str(e))) from None


async def _best_of(stream: AsyncIterator[RequestOutput], n: int) -> AsyncIterator[RequestOutput]:
    """The last output only, keeping its n completions of highest cumulative logprob, renumbered 0..n-1."""
    out = None
    async for out in stream:
        pass
    best = sorted(out.outputs, key=lambda c: -c.cumulative_logprob)[:n]
    yield dataclasses.replace(out, outputs=[dataclasses.replace(c, index=i) for i, c in enumerate(best)])


async def _merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's index."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
        except Exception as e:
            await queue.put((i, e))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def _choice_updates(
    streams: list[AsyncIterator[RequestOutput]], n: int, usage: dict[int, RequestOutput]
) -> AsyncIterator[tuple[int, RequestOutput, CompletionOutput, ChoiceProgress]]:
    """The one streaming loop of completions and chat: (choice index, output, completion, what was sent of it
    before), for every completion not finished yet; what was sent advances once the caller has taken an item.
    Each prompt's final output lands in `usage`."""
    indexer = ChoiceIndexer(n)
    async for i, out in _merge(streams):
        for c in out.outputs:
            index = indexer.index(i, c.index)
            sent = indexer.of(index)
            if sent.finished:  # outputs repeat every completion of the request; a finished one was sent in full
                continue
            yield index, out, c, sent
            sent.text_len, sent.logprobs_len, sent.started, sent.finished = (
                len(c.text),
                len(c.token_ids),
                True,
                c.finish_reason is not None,
            )
        if out.finished:
            usage[i] = out


def _usage_chunk(meta: dict, usage: dict[int, RequestOutput]) -> dict:
    total = Usage()
    for out in usage.values():
        total.add(out)
    return meta | {"choices": [], "usage": total.as_dict()}


def _prompt_logprobs_field(body: CompletionRequest | ChatCompletionRequest, out: RequestOutput) -> dict:
    """vLLM's prompt_logprobs, when the request asked for them by that name."""
    return {"prompt_logprobs": prompt_logprobs(out)} if body.prompt_logprobs is not None else {}


async def _completion_chunks(
    streams,
    params: SamplingParams,
    body: CompletionRequest,
    meta: dict,
    echoed: Callable[[RequestOutput], tuple[str, dict | None]],
) -> AsyncIterator[dict]:
    usage: dict[int, RequestOutput] = {}
    async for index, out, c, sent in _choice_updates(streams, body.n, usage):
        text, first = c.text[sent.text_len :], not sent.started
        echo, echo_logprobs = echoed(out) if first else ("", None)
        logprobs = (
            completion_logprobs(c, sent.logprobs_len, body.logprobs, len(echo) + sent.text_len)
            if body.logprobs is not None
            else None
        )
        if echo_logprobs is not None:
            logprobs = join_logprobs(echo_logprobs, logprobs)
        if echo or text or c.finish_reason or logprobs and logprobs["tokens"]:
            extra = _prompt_logprobs_field(body, out) if first else {}
            yield meta | {
                "choices": [
                    {
                        "index": index,
                        "text": echo + text,
                        "logprobs": logprobs,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                    | extra
                ]
            }
    if body.include_usage:
        yield _usage_chunk(meta, usage)


async def _chat_chunks(
    stream, params: SamplingParams, body: ChatCompletionRequest, meta: dict, may_call_tools: bool
) -> AsyncIterator[dict]:
    usage: dict[int, RequestOutput] = {}
    replies: dict[int, ToolCallStream] = {}
    async for index, out, c, sent in _choice_updates([stream], params.n, usage):
        delta = {} if sent.started else {"role": "assistant"}
        extra = _prompt_logprobs_field(body, out) if not sent.started and index == 0 else {}
        logprobs = chat_logprobs(c, sent.logprobs_len, params.logprobs) if params.logprobs is not None else None
        finish_reason = c.finish_reason
        if may_call_tools:  # content and tool-call deltas from the reply parsed so far
            reply = replies.setdefault(index, ToolCallStream())
            delta |= reply.delta(c.text, c.finish_reason is not None)
            finish_reason = reply.finish_reason(c.finish_reason)
            if logprobs and logprobs["content"] and not delta:
                delta["content"] = ""
        else:
            # A token that adds no text yet (part of a UTF-8 character, text held back for a stop string) still
            # sends its logprobs, with empty content: skipping its chunk lost them.
            text = c.text[sent.text_len :]
            if text or not sent.started or logprobs and logprobs["content"]:
                delta["content"] = text
        if delta or c.finish_reason:
            yield (
                meta
                | {
                    "choices": [
                        {
                            "index": index,
                            "delta": delta,
                            "logprobs": logprobs,
                            "finish_reason": finish_reason,
                            "stop_reason": c.stop_reason,
                        }
                    ]
                }
                | extra
            )
    if body.include_usage and usage:
        yield _usage_chunk(meta, usage)


def _openapi(app: FastAPI, bounds: dict[str, int], max_model_len: int, vocab_size: int) -> dict:
    """FastAPI's schema, made true to this server: validation errors are 400s (documented), never 422s, and the
    bounds that depend on the server are written in (n by --max-n, max_tokens by the context, token ids by
    the vocabulary)."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path in schema["paths"].values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        components = schema.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        for name in ("CompletionRequest", "ChatCompletionRequest"):
            for field, schema_of_field in components[name]["properties"].items():
                if field in bounds:
                    for integer in _integer_schemas(schema_of_field):
                        integer["maximum"] = bounds[field]
        prompt = components["CompletionRequest"]["properties"]["prompt"]
        token_fields = [prompt, components["DetokenizeRequest"]["properties"]["tokens"]] + [
            components[name]["properties"]["allowed_token_ids"]
            for name in ("CompletionRequest", "ChatCompletionRequest")
        ]
        for integer in (i for field in token_fields for i in _integer_schemas(field)):
            integer["maximum"] = vocab_size - 1
        for token_list in _token_lists(prompt):
            token_list["maxItems"] = max_model_len - 1
        app.openapi_schema = schema
    return app.openapi_schema


def _subschemas(schema: dict, want) -> list[dict]:
    """The schemas inside a property's schema (itself, its anyOf branches, array items) for which want() holds."""
    found = [schema] if want(schema) else []
    for sub in schema.get("anyOf", []) + ([schema["items"]] if "items" in schema else []):
        found += _subschemas(sub, want)
    return found


def _integer_schemas(schema: dict) -> list[dict]:
    return _subschemas(schema, lambda s: s.get("type") == "integer")


def _token_lists(schema: dict) -> list[dict]:
    return _subschemas(schema, lambda s: s.get("type") == "array" and s.get("items", {}).get("type") == "integer")
