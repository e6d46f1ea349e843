"""The OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenloop.engine.async_engine import AsyncEngine
from tokenloop.outputs import RequestOutput
from tokenloop.sampling.params import SamplingParams
from tokenloop.server.protocol import ChatCompletionRequest, CompletionRequest
from tokenloop.server.responses import ChoiceIndexer, Usage, chat_logprobs, completion_logprobs

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 500: "internal_server_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "error"), "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def _param_of(message: str) -> str | None:
    """Our ValueErrors start with the offending field's name ("temperature must be ...")."""
    first = message.split(" ", 1)[0].rstrip(":")
    return first if first.isidentifier() and first not in ("the", "a", "prompt") else None


class _RequireAPIKey:
    """401 on /v1 routes without 'Authorization: Bearer KEY'. Plain ASGI on purpose: under Starlette's
    BaseHTTPMiddleware (@app.middleware) Request.is_disconnected() never turns true, so a non-streamed
    request whose client left would run to its end."""

    def __init__(self, app, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            if dict(scope["headers"]).get(b"authorization") != self.expected:
                await error_response(401, "invalid or missing API key")(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: AsyncEngine, model_name: str, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="tokenloop", docs_url=None, redoc_url=None)
    max_model_len = engine.engine.max_model_len

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, e.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        err = e.errors()[0] if e.errors() else {}
        if err.get("type") == "json_invalid":  # its loc is a character offset, not a field
            return error_response(400, f"invalid JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}")
        loc = [str(part) for part in err.get("loc", ()) if part != "body"]
        message = f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid request')}"
        return error_response(400, message, loc[0] if loc else None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return error_response(e.status_code, str(e.detail))

    if api_key is not None:
        app.add_middleware(_RequireAPIKey, api_key=api_key)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "tokenloop", "max_model_len": max_model_len}
        return {"object": "list", "data": [card]}

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{model_name}`.", "model")

    def start_streams(prompts: list, params: SamplingParams) -> list[AsyncIterator[RequestOutput]]:
        """Validate every prompt before starting any, so that a bad one leaves nothing running."""
        try:
            tokenized = [engine.engine.process_prompt(p, params) for p in prompts]
        except ValueError as e:
            raise APIError(400, str(e), _param_of(str(e)) or "prompt") from None
        return [engine.generate(t, params) for t in tokenized]

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        params = _params(lambda: body.sampling_params(body.max_tokens, body.logprobs))
        if body.echo and body.logprobs is not None:
            raise APIError(400, "echo together with logprobs is not supported", "echo")
        try:
            prompts = body.prompts()
        except ValueError as e:
            raise APIError(400, str(e), "prompt") from None
        streams = start_streams(prompts, params)
        meta = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()), "model": model_name}

        def prompt_text(out: RequestOutput) -> str:  # what echo returns; token-id prompts have no text of their own
            return out.prompt if out.prompt is not None else engine.engine.tokenizer.decode(out.prompt_token_ids)

        if body.stream:
            return _sse(_completion_chunks(streams, params, body, meta, prompt_text))
        outs = await _until_disconnected(request, _collect(streams))
        usage, choices = Usage(), []
        for i, out in enumerate(outs):
            usage.add(out)
            echo = prompt_text(out) if body.echo else ""
            for c in out.outputs:
                logprobs = completion_logprobs(c, 0, body.logprobs, 0) if body.logprobs is not None else None
                choices.append({"index": i * params.n + c.index, "text": echo + c.text, "logprobs": logprobs, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return JSONResponse(meta | {"choices": choices, "usage": usage.as_dict()})

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        params = _params(lambda: body.sampling_params(body.effective_max_tokens(), body.effective_logprobs()))
        try:
            if not body.messages:
                raise ValueError("messages must not be empty")
            messages = [m.as_template_message() for m in body.messages]
            prompt = engine.engine.chat_prompt(messages, body.add_generation_prompt)
        except ValueError as e:
            raise APIError(400, str(e), "messages") from None
        streams = start_streams([prompt], params)
        meta = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()), "model": model_name}
        if body.stream:
            return _sse(_chat_chunks(streams[0], params, body, meta | {"object": "chat.completion.chunk"}))
        (out,) = await _until_disconnected(request, _collect(streams))
        usage = Usage()
        usage.add(out)
        choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(c, 0, params.logprobs) if params.logprobs is not None else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for c in out.outputs
        ]
        return JSONResponse(meta | {"choices": choices, "usage": usage.as_dict()})

    return app


def _params(make) -> SamplingParams:
    try:
        return make()
    except ValueError as e:
        raise APIError(400, str(e), _param_of(str(e))) from None


async def _collect(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    async def last(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
        out = None
        async for out in stream:
            pass
        return out

    return list(await asyncio.gather(*(last(s) for s in streams)))


async def _until_disconnected(request: Request, coro):
    """Run `coro`, cancelling it (which aborts its requests) if the client goes away first."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise APIError(499, "client disconnected")
    finally:
        task.cancel()


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


def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        except APIError as e:
            yield f"data: {json.dumps(error_body(e.status, e.message, e.param))}\n\n"
        except Exception as e:  # the stream has started: report in-band, the server goes on
            yield f"data: {json.dumps(error_body(500, str(e)))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


async def _completion_chunks(streams, params: SamplingParams, body: CompletionRequest, meta: dict, prompt_text: Callable[[RequestOutput], str]) -> AsyncIterator[dict]:
    indexer, usage = ChoiceIndexer(params.n), {}
    async for i, out in _merge(streams):
        for c in out.outputs:
            index = indexer.index(i, c.index)
            sent = indexer.of(index)
            if sent.finished:  # outputs repeat every completion of the request; a finished one was sent in full
                continue
            text = c.text[sent.text_len :]
            if body.echo and not sent.started:
                text = prompt_text(out) + text
            logprobs = completion_logprobs(c, sent.logprobs_len, body.logprobs, sent.text_len) if body.logprobs is not None else None
            if text or c.finish_reason or logprobs and logprobs["tokens"]:
                yield meta | {"choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]}
            sent.text_len, sent.logprobs_len, sent.started, sent.finished = len(c.text), len(c.token_ids), True, c.finish_reason is not None
        if out.finished:
            usage[i] = out
    if body.include_usage:
        total = Usage()
        for out in usage.values():
            total.add(out)
        yield meta | {"choices": [], "usage": total.as_dict()}


async def _chat_chunks(stream, params: SamplingParams, body: ChatCompletionRequest, meta: dict) -> AsyncIterator[dict]:
    indexer, final = ChoiceIndexer(params.n), None
    async for out in stream:
        for c in out.outputs:
            sent = indexer.of(c.index)
            if sent.finished:
                continue
            delta = {} if sent.started else {"role": "assistant"}
            text = c.text[sent.text_len :]
            if text or not sent.started:
                delta["content"] = text
            logprobs = chat_logprobs(c, sent.logprobs_len, params.logprobs) if params.logprobs is not None else None
            if delta or c.finish_reason:
                yield meta | {"choices": [{"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]}
            sent.text_len, sent.logprobs_len, sent.started, sent.finished = len(c.text), len(c.token_ids), True, c.finish_reason is not None
        final = out
    if body.include_usage and final is not None:
        usage = Usage()
        usage.add(final)
        yield meta | {"choices": [], "usage": usage.as_dict()}
