"""A Messages API reply built from the `anthropic` package's own types: the Message, or the named events of its
stream (anthropic_messages.py's routes import this on their first request: the package and its 3,000 modules
weigh about 40 MiB of resident memory, which a server that never answers /v1/messages does without)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

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
from pydantic import BaseModel

from tokenloop.outputs import CompletionOutput, RequestOutput
from tokenloop.server.responses import ToolCallStream
from tokenloop.tools.parser import parse_reply


def dump(model: BaseModel) -> dict:
    # Only the fields set: the SDK's many optional fields (container, citations, caller, ...) stay out, as in
    # Anthropic's own replies, and a message sent back as a later turn's content carries nothing unknown.
    return model.model_dump(mode="json", exclude_unset=True)


def _tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True, slots=True)
class Reply:
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


async def events(stream: AsyncIterator[RequestOutput], reply: Reply) -> AsyncIterator[dict]:
    """message_start and a ping once the first output is in (its usage known then), the content blocks' events,
    then message_delta (stop reason, usage) and message_stop."""
    blocks, out = _BlockStream(reply.may_call_tools), None
    async for out in stream:
        if not blocks.started:
            blocks.started = True
            yield dump(reply.start_event(out))
            yield {"type": "ping"}
        c = out.outputs[0]
        for event in blocks.update(c.text, c.finish_reason is not None):
            yield dump(event)
    for event in blocks.close():
        yield dump(event)
    c = out.outputs[0]
    stop_reason, stop_sequence = reply.stop(c, blocks.called(c.finish_reason))
    usage = reply.usage(out)
    yield dump(
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
    yield dump(RawMessageStopEvent(type="message_stop"))


def token_count(n: int) -> dict:
    """count_tokens' reply."""
    return dump(MessageTokensCount(input_tokens=n))
