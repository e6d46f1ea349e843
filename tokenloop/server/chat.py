"""OpenAI's /v1/chat/completions: a conversation through the chat template, tools and their calls, structured
output and self-consistency, streamed or not."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tokenloop.outputs import RequestOutput
from tokenloop.sampling.params import SamplingParams
from tokenloop.server.errors import error_body
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
from tokenloop.server.protocol import ChatCompletionRequest
from tokenloop.server.responses import ToolCallStream, Usage, chat_logprobs, chat_message


def add_chat_routes(app: FastAPI, generation: Generation, bounds: Bounds) -> None:
    @app.post("/v1/chat/completions", responses=GENERATION_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        model = generation.check_model(body.model)
        bounds.check(body)
        params = params_or_400(lambda: body.sampling_params(body.effective_max_tokens(), body.effective_logprobs()))
        tools = params_or_400(body.tool_calling)
        messages = [m.as_template_message() for m in body.messages]
        prompt = await generation.chat_prompt(messages, tools, body.add_generation_prompt, body.continue_final_message)
        vote = params_or_400(body.answer_spec)
        if vote is not None:
            params = vote.params(params, body.n)
        streams = await generation.start([prompt], params, renamed_fields(body), model)
        meta = meta_of("chatcmpl", "chat.completion", model.name)
        if vote is not None:
            return await voted(
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
        return JSONResponse(meta | {"choices": choices, "usage": usage.as_dict()} | prompt_logprobs_field(body, out))


async def _chat_chunks(
    stream, params: SamplingParams, body: ChatCompletionRequest, meta: dict, may_call_tools: bool
) -> AsyncIterator[dict]:
    usage: dict[int, RequestOutput] = {}
    replies: dict[int, ToolCallStream] = {}
    async for index, out, c, sent in choice_updates([stream], params.n, usage):
        delta = {} if sent.started else {"role": "assistant"}
        extra = prompt_logprobs_field(body, out) if not sent.started and index == 0 else {}
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
        yield usage_chunk(meta, usage)
