"""A Responses API reply built from the `openai` package's own types: its output items, the response object, and the
named events of its stream (openai_responses.py's routes import this on their first request: the package weighs
about 20 MiB of resident memory, which a server that never answers /v1/responses does without)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from openai.types.responses import (
    Response as ResponseBody,
)
from openai.types.responses import (
    ResponseCompletedEvent,
    ResponseContentPartAddedEvent,
    ResponseContentPartDoneEvent,
    ResponseCreatedEvent,
    ResponseErrorEvent,
    ResponseFunctionCallArgumentsDeltaEvent,
    ResponseFunctionCallArgumentsDoneEvent,
    ResponseFunctionToolCall,
    ResponseIncompleteEvent,
    ResponseInProgressEvent,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseTextDeltaEvent,
    ResponseTextDoneEvent,
    ResponseUsage,
)
from pydantic import BaseModel

from tokenloop.engine.async_engine import RequestFailed
from tokenloop.outputs import CompletionOutput, RequestOutput
from tokenloop.server.errors import APIError, error_body
from tokenloop.server.responses import ToolCallStream
from tokenloop.server.responses_protocol import ResponsesRequest


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(slots=True)
class OutputBuilder:
    """A response's output items, built from its completion as it grows, and the events that say each change (with
    sequence numbers from 0). The non-streamed reply is the same builder fed the final output once."""

    tools: ToolCallStream | None  # set when the reply may hold tool calls
    items: list[dict[str, Any]] = field(default_factory=list)  # JSON; the last one is open until `closed`
    closed: bool = True
    text_len: int = 0
    sequence: int = 0

    def event(self, kind: type[BaseModel], **fields: Any) -> dict:
        kind_name = kind.model_fields["type"].annotation.__args__[0]
        event = kind.model_validate({"type": kind_name, **fields, "sequence_number": self.sequence})
        self.sequence += 1
        return event.model_dump(mode="json", exclude_none=True)

    def error_event(self, status: int, message: str, param: str | None) -> dict:
        """The event that ends a stream a failure cut short, as sse() asks for it."""
        code = error_body(status, message)["error"]["type"]
        return self.event(ResponseErrorEvent, code=code, message=message, param=param)

    def update(self, c: CompletionOutput) -> list[dict]:
        finished = c.finish_reason is not None
        if self.tools is not None:
            delta = self.tools.delta(c.text, finished)
        else:
            delta = {"content": c.text[self.text_len :]}
            self.text_len = len(c.text)
        events = []
        if content := delta.get("content"):
            if self.closed or self.items[-1]["type"] != "message":
                events += self._close("completed") + self._open(self._message())
            self.items[-1]["content"][0]["text"] += content
            events.append(self.event(ResponseTextDeltaEvent, delta=content, logprobs=[], **self._where(text=True)))
        for call in delta.get("tool_calls", ()):
            if "id" in call:  # a call starts
                events += self._close("completed") + self._open(self._call(call["id"], call["function"]["name"]))
            if piece := call["function"]["arguments"]:
                self.items[-1]["arguments"] += piece
                events.append(self.event(ResponseFunctionCallArgumentsDeltaEvent, delta=piece, **self._where()))
        if finished:
            if not self.items:  # an empty reply is still a message
                events += self._open(self._message())
            events += self._close("incomplete" if c.finish_reason == "length" else "completed")
        return events

    def _where(self, text: bool = False) -> dict:
        where = {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}
        return where | {"content_index": 0} if text else where

    def _message(self) -> dict:
        part = ResponseOutputText(type="output_text", text="", annotations=[], logprobs=[])
        message = ResponseOutputMessage(
            id=new_id("msg"), type="message", role="assistant", status="in_progress", content=[part]
        )
        return message.model_dump(mode="json", exclude_none=True)

    def _call(self, call_id: str, name: str) -> dict:
        call = ResponseFunctionToolCall(
            id=new_id("fc"), type="function_call", call_id=call_id, name=name, arguments="", status="in_progress"
        )
        return call.model_dump(mode="json", exclude_none=True)

    def _open(self, item: dict) -> list[dict]:
        self.items.append(item)
        self.closed = False
        snapshot = {**item, "content": []} if item["type"] == "message" else item
        events = [self.event(ResponseOutputItemAddedEvent, item=snapshot, output_index=len(self.items) - 1)]
        if item["type"] == "message":
            events.append(self.event(ResponseContentPartAddedEvent, part=item["content"][0], **self._where(text=True)))
        return events

    def _close(self, status: str) -> list[dict]:
        if self.closed:
            return []
        self.closed = True
        item = self.items[-1]
        if item["type"] == "function_call" and status == "incomplete":  # a call the length cut has no whole object
            status = "completed" if _whole_json(item["arguments"]) else "incomplete"
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            events = [
                self.event(ResponseTextDoneEvent, text=part["text"], logprobs=[], **self._where(text=True)),
                self.event(ResponseContentPartDoneEvent, part=part, **self._where(text=True)),
            ]
        else:
            events = [self.event(ResponseFunctionCallArgumentsDoneEvent, arguments=item["arguments"], **self._where())]
        return events + [self.event(ResponseOutputItemDoneEvent, item=item, output_index=len(self.items) - 1)]


def _whole_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def _usage(out: RequestOutput) -> dict:
    prompt, completion = len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs)
    return ResponseUsage(
        input_tokens=prompt,
        # every input token not read from the prefix cache had its K/V computed and written into the cache
        input_tokens_details={
            "cached_tokens": out.num_cached_tokens,
            "cache_write_tokens": prompt - out.num_cached_tokens,
        },
        output_tokens=completion,
        output_tokens_details={"reasoning_tokens": 0},
        total_tokens=prompt + completion,
    ).model_dump(mode="json", exclude_none=True)


def response_object(body: ResponsesRequest, meta: dict, output: list[dict], out: RequestOutput | None) -> dict:
    """The response object: in progress (no `out` yet), completed, or incomplete (the length ran out)."""
    finish = out.outputs[0].finish_reason if out is not None else None
    status = "in_progress" if out is None else "incomplete" if finish == "length" else "completed"
    choice = body.tool_choice
    fmt = body.text.format if body.text is not None else None
    response = ResponseBody.model_validate(
        meta
        | {
            "object": "response",
            "status": status,
            "output": output,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions,
            "metadata": body.metadata or {},
            "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "tool_choice": choice.model_dump() if isinstance(choice, BaseModel) else choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "truncation": "disabled",
            "usage": _usage(out) if out is not None else None,
            "user": body.user,
        }
    )
    return response.model_dump(mode="json", exclude_none=True) | {"store": body.store is not False, "error": None}


async def events(
    body: ResponsesRequest,
    meta: dict,
    builder: OutputBuilder,
    stream: AsyncIterator[RequestOutput],
    keep: Callable[[dict], None],
) -> AsyncIterator[dict]:
    """The named events the SDK builds its state from: created, in_progress, each item's events, then completed
    or incomplete (whose response is what a non-streamed request returns)."""
    started = response_object(body, meta, [], None)
    yield builder.event(ResponseCreatedEvent, response=started)
    yield builder.event(ResponseInProgressEvent, response=started)
    out = None
    try:
        async for out in stream:
            for event in builder.update(out.outputs[0]):
                yield event
    except RequestFailed as e:
        raise APIError(500, f"the engine failed this request: {e}") from None
    response = response_object(body, meta, builder.items, out)
    keep(response)
    kind = ResponseIncompleteEvent if response["status"] == "incomplete" else ResponseCompletedEvent
    yield builder.event(kind, response=response)
