"""OpenAI's /v1/completions: text or token-id prompts, n and best_of, echo with the prompt's logprobs, beam search
and self-consistency (extensions), streamed or not."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tokenloop.outputs import RequestOutput
from tokenloop.sampling.params import SamplingParams
from tokenloop.server.errors import APIError, error_body
from tokenloop.server.generation import GENERATION_RESPONSES, Generation, params_or_400, sse
from tokenloop.server.openai_shared import (
    Bounds,
    choice_updates,
    meta_of,
    prompt_logprobs_field,
    renamed_fields,
    usage_chunk,
    voted,
)
from tokenloop.server.protocol import CompletionRequest
from tokenloop.server.responses import Usage, completion_logprobs, join_logprobs, legacy_logprobs


def add_completions_routes(app: FastAPI, generation: Generation, bounds: Bounds) -> None:
    inputs = generation.inputs

    @app.post("/v1/completions", responses=GENERATION_RESPONSES)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        model = generation.check_model(body.model)
        bounds.check(body)
        # best_of > n: that many completions run, and the n with the highest cumulative logprob are returned.
        best_of = body.best_of or body.n
        logprobs = 0 if best_of > body.n and body.logprobs is None else body.logprobs  # to rank them
        # echo with logprobs returns the prompt's tokens' logprobs too, as OpenAI's legacy API did
        echo_logprobs = body.logprobs if body.echo else None
        beams = params_or_400(body.beam_search_params)  # best_of (or n) beams, the n best returned
        params = beams or params_or_400(
            lambda: body.sampling_params(body.max_tokens, logprobs, n=best_of, prompt_logprobs=echo_logprobs)
        )
        vote = params_or_400(body.answer_spec)
        if vote is not None:
            if len(body.prompts()) != 1:
                raise APIError(400, "self_consistency takes one prompt", "prompt")
            params = vote.params(params, body.n)
        streams = await generation.start(body.prompts(), params, renamed_fields(body), model)
        if vote is not None:
            return await voted(
                request,
                streams[0],
                vote,
                body.n,
                meta_of("cmpl", "text_completion", model.name),
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
        meta = meta_of("cmpl", "text_completion", model.name)

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
                    | prompt_logprobs_field(body, out)
                )
        return JSONResponse(meta | {"choices": choices, "usage": usage.as_dict()})


async def _best_of(stream: AsyncIterator[RequestOutput], n: int) -> AsyncIterator[RequestOutput]:
    """The last output only, keeping its n completions of highest cumulative logprob, renumbered 0..n-1."""
    out = None
    async for out in stream:
        pass
    best = sorted(out.outputs, key=lambda c: -c.cumulative_logprob)[:n]
    yield dataclasses.replace(out, outputs=[dataclasses.replace(c, index=i) for i, c in enumerate(best)])


async def _completion_chunks(
    streams,
    params: SamplingParams,
    body: CompletionRequest,
    meta: dict,
    echoed: Callable[[RequestOutput], tuple[str, dict | None]],
) -> AsyncIterator[dict]:
    usage: dict[int, RequestOutput] = {}
    async for index, out, c, sent in choice_updates(streams, body.n, usage):
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
            extra = prompt_logprobs_field(body, out) if first else {}
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
        yield usage_chunk(meta, usage)
