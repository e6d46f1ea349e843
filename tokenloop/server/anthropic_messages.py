"""Anthropic's Messages API: POST /v1/messages (a message, or its stream of named events) and
POST /v1/messages/count_tokens, and Anthropic's error shape for every refusal under /v1/messages.

A translation onto the Generation seam, as OpenAI's chat is: the body becomes chat messages and a ToolCalling
(anthropic_protocol.py), the reply is built from the `anthropic` package's own types. Usage follows Anthropic's
meaning: input_tokens + cache_read_input_tokens is the prompt (what count_tokens says), the part read from the
prefix cache counted apart.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal

from anthropic.types import (
    InputJSONDelta,
    Message,
    MessageDeltaUsage,
    MessageTokensCount,
    RawContentBlockDeltaEvent,
    RawContentBlockStartEvent,
    RawContentBlockStopEvent,
    RawMessageDeltaEvent,
    RawMessageStartEvent,
    RawMessageStopEvent,
    TextBlock,
    TextDelta,
    ToolUseBlock,
    Usage,
)
from anthropic.types.raw_message_delta_event import Delta
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from tokenloop.outputs import CompletionOutput, RequestOutput
from tokenloop.sampling.params import SamplingParams
from tokenloop.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from tokenloop.server.errors import APIError
from tokenloop.server.generation import Generation, params_or_400, sse
from tokenloop.server.responses import ToolCallStream
from tokenloop.tools.calling import ToolCalling
from tokenloop.tools.parser import parse_reply

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error_body(status: int, message: str, param: str | None = None) -> dict:
    """Anthropic's error shape; it has no param, so the message names the field."""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    type: Literal["error"]
    error: AnthropicErrorDetail


_ERRORS = {
    status: {"model": AnthropicError, "description": _ERROR_TYPES[status].replace("_", " ")}
    for status in (400, 401, 404, 413, 429, 500, 503)
}
_MESSAGE_RESPONSES = _ERRORS | {
    200: {
        "description": "the message, or with stream: true a stream of named server-sent events",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "text/event-stream": {  # each event named by its type
                "schema": {
                    "type": "object",
                    "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
                    "required": ["event", "data"],
                }
            },
        },
    },
}

# SamplingParams' field names in its errors, as this API calls them
_RENAMED = {"stop": "stop_sequences"}


def add_messages_routes(app: FastAPI, generation: Generation) -> None:
    schema_of = app.openapi

    def openapi() -> dict:
        """The served schema, with what depends on this server written in: the model names (the base model's and
        its adapters'; any other is a 404, and the field is required), max_tokens bounded by the context."""
        schema = schema_of()
        components = schema["components"]["schemas"]
        for name in ("MessagesRequest", "CountTokensRequest"):
            components[name]["properties"]["model"]["enum"] = generation.model_names
        components["MessagesRequest"]["properties"]["max_tokens"]["maximum"] = generation.inputs.max_model_len - 1
        return schema

    app.openapi = openapi

    @app.post("/v1/messages", responses=_MESSAGE_RESPONSES)
    async def messages(body: MessagesRequest, request: Request) -> Response:
        """Anthropic's Messages API: a reply to the conversation, streamed as named events with stream: true."""
        model = generation.check_model(body.model)
        tools, prompt = await _prompt(generation, body)
        streams = await generation.start([prompt], _sampling_params(body, tools), _RENAMED, model)
        reply = _Reply(model.name, body.stop_sequences or [], tools is not None and tools.constrained)
        if body.stream:
            return sse(_events(streams[0], reply), anthropic_error_body, named=True, done=False)
        (out,) = await generation.collect(request, streams)
        return JSONResponse(_dump(reply.message(out)))

    @app.post("/v1/messages/count_tokens", responses=_ERRORS | {200: {"model": MessageTokensCount}})
    async def count_tokens(body: CountTokensRequest) -> JSONResponse:
        """The prompt's tokens, tools included: a message's usage input_tokens + cache_read_input_tokens."""
        generation.check_model(body.model)
        _, prompt = await _prompt(generation, body)
        return JSONResponse(_dump(MessageTokensCount(input_tokens=len(prompt["prompt_token_ids"]))))


async def _prompt(generation: Generation, body: CountTokensRequest) -> tuple[ToolCalling | None, dict]:
    """The body's tools and its prompt; a last assistant turn is continued (Anthropic's prefill)."""
    tools = params_or_400(body.tool_calling)
    try:
        messages, continues = body.conversation()
    except ValueError as e:
        raise APIError(400, str(e), "messages") from None
    try:
        return tools, await generation.chat_prompt(messages, tools, not continues, continues)
    except APIError as e:
        if e.param != "continue_final_message":
            raise
        # the client sent no continue_final_message: its last message is what cannot be continued
        raise APIError(400, f"messages: {e.message.removeprefix('continue_final_message: ')}", "messages") from None


def _sampling_params(body: MessagesRequest, tools: ToolCalling | None) -> SamplingParams:
    return params_or_400(
        lambda: SamplingParams(
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k or -1,  # Anthropic's top_k is >= 0 with no "off" value: absent is off
            seed=body.seed,
            stop=body.stop_sequences or [],
            structured_outputs=tools.structured_outputs() if tools is not None else None,
        )
    )


def _dump(model: BaseModel) -> dict:
    # Only the fields set: the SDK's many optional fields (container, citations, caller, ...) stay out, as in
    # Anthropic's own replies, and a message sent back as a later turn's content carries nothing unknown.
    return model.model_dump(mode="json", exclude_unset=True)


def _tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True, slots=True)
class _Reply:
    """How a request's outputs read as a Message: its stop reason and usage, and its content."""

    model: str
    stop_sequences: list[str]
    may_call_tools: bool
    id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex[:24]}")

    def stop(self, c: CompletionOutput, called: bool) -> tuple[str, str | None]:
        """stop_reason and stop_sequence: the matched string, when one of stop_sequences ended the reply."""
        if c.finish_reason == "length":
            return "max_tokens", None
        if called and c.finish_reason == "stop":
            return "tool_use", None
        if isinstance(c.stop_reason, str) and c.stop_reason in self.stop_sequences:
            return "stop_sequence", c.stop_reason
        return "end_turn", None

    def usage(self, out: RequestOutput) -> Usage:
        cached = out.num_cached_tokens
        return Usage(
            input_tokens=len(out.prompt_token_ids) - cached,
            output_tokens=len(out.outputs[0].token_ids),
            cache_read_input_tokens=cached,
            cache_creation_input_tokens=0,  # blocks enter the prefix cache on their own: nothing is billed for it
        )

    def message(self, out: RequestOutput) -> Message:
        c = out.outputs[0]
        reply = parse_reply(c.text, finished=True) if self.may_call_tools else None
        text = reply.content if reply is not None else c.text
        content: list[TextBlock | ToolUseBlock] = [TextBlock(type="text", text=text)] if text else []
        for call in reply.calls if reply is not None else []:
            content.append(
                ToolUseBlock(type="tool_use", id=_tool_use_id(), name=call.name, input=json.loads(call.arguments))
            )
        stop_reason, stop_sequence = self.stop(c, called=reply is not None and bool(reply.calls))
        return self._message(content, stop_reason, stop_sequence, self.usage(out))

    def _message(self, content: list, stop_reason: str | None, stop_sequence: str | None, usage: Usage) -> Message:
        return Message(
            id=self.id,
            type="message",
            role="assistant",
            model=self.model,
            content=content,
            stop_reason=stop_reason,
            stop_sequence=stop_sequence,
            usage=usage,
        )

    def start_event(self, out: RequestOutput) -> RawMessageStartEvent:
        usage = self.usage(out)
        usage.output_tokens = 0
        return RawMessageStartEvent(type="message_start", message=self._message([], None, None, usage))


@dataclass(slots=True)
class _BlockStream:
    """The content blocks a stream has opened: text as text_delta pieces, then each tool call as a tool_use block
    whose input arrives as input_json_delta pieces (ToolCallStream reads them out of the reply so far)."""

    may_call_tools: bool
    calls: ToolCallStream = field(default_factory=ToolCallStream)
    text_len: int = 0
    started: bool = False  # message_start sent
    index: int = -1  # of the block last opened
    open: bool = False

    def update(self, text: str, finished: bool) -> list[BaseModel]:
        if self.may_call_tools:
            delta = self.calls.delta(text, finished)
            content, calls = delta.get("content", ""), delta.get("tool_calls", [])
        else:
            content, calls, self.text_len = text[self.text_len :], [], len(text)
        events: list[BaseModel] = []
        if content:
            if not self.open:
                events += self._start(TextBlock(type="text", text=""))
            events.append(
                RawContentBlockDeltaEvent(
                    type="content_block_delta", index=self.index, delta=TextDelta(type="text_delta", text=content)
                )
            )
        for call in calls:
            if "id" in call:  # a new call: its block opens with its name and an empty input
                block = ToolUseBlock(type="tool_use", id=_tool_use_id(), name=call["function"]["name"], input={})
                events += self._start(block)
            if piece := call["function"]["arguments"]:
                delta = InputJSONDelta(type="input_json_delta", partial_json=piece)
                events.append(RawContentBlockDeltaEvent(type="content_block_delta", index=self.index, delta=delta))
        return events

    def close(self) -> list[BaseModel]:
        if not self.open:
            return []
        self.open = False
        return [RawContentBlockStopEvent(type="content_block_stop", index=self.index)]

    def called(self, finish_reason: str | None) -> bool:
        return self.may_call_tools and self.calls.finish_reason(finish_reason) == "tool_calls"

    def _start(self, block: TextBlock | ToolUseBlock) -> list[BaseModel]:
        events = self.close()
        self.index, self.open = self.index + 1, True
        return events + [RawContentBlockStartEvent(type="content_block_start", index=self.index, content_block=block)]


async def _events(stream: AsyncIterator[RequestOutput], reply: _Reply) -> AsyncIterator[dict]:
    """message_start and a ping once the first output is in (its usage known then), the content blocks' events,
    then message_delta (stop reason, usage) and message_stop."""
    blocks, out = _BlockStream(reply.may_call_tools), None
    async for out in stream:
        if not blocks.started:
            blocks.started = True
            yield _dump(reply.start_event(out))
            yield {"type": "ping"}
        c = out.outputs[0]
        for event in blocks.update(c.text, c.finish_reason is not None):
            yield _dump(event)
    for event in blocks.close():
        yield _dump(event)
    c = out.outputs[0]
    stop_reason, stop_sequence = reply.stop(c, blocks.called(c.finish_reason))
    usage = reply.usage(out)
    yield _dump(
        RawMessageDeltaEvent(
            type="message_delta",
            delta=Delta(stop_reason=stop_reason, stop_sequence=stop_sequence),
            usage=MessageDeltaUsage(
                input_tokens=usage.input_tokens,
                output_tokens=usage.output_tokens,
                cache_read_input_tokens=usage.cache_read_input_tokens,
                cache_creation_input_tokens=usage.cache_creation_input_tokens,
            ),
        )
    )
    yield _dump(RawMessageStopEvent(type="message_stop"))
