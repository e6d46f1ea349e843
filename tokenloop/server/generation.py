"""What every generating route shares, whatever API it speaks (OpenAI's completions, chat and responses,
Anthropic's messages): a conversation made into a prompt, prompts admitted and processed into streams of
RequestOutputs, a reply collected unless the client leaves, and events sent as server-sent events.

Each API's module is a translation: its body into messages, a ToolCalling and SamplingParams, through here into
the engine's InputProcessor, and RequestOutputs back into its own reply. Validation, templating, tool parsing and
grammars live once, behind this.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from tokenloop.engine.async_engine import RequestFailed
from tokenloop.engine.beam_search import BeamSearchParams
from tokenloop.engine.client import EngineClient
from tokenloop.engine.input_processor import InputProcessor, Prompt
from tokenloop.engine.lora import LoRARequest
from tokenloop.outputs import RequestOutput
from tokenloop.sampling.params import SamplingParams
from tokenloop.server.errors import ERROR_RESPONSES, APIError, param_of
from tokenloop.tools.calling import ToolCalling

GENERATION_RESPONSES = ERROR_RESPONSES | {
    200: {
        "description": "the reply, or with stream: true a stream of server-sent events",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "text/event-stream": {
                "schema": {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}
            },
        },
    },
}


@dataclass(frozen=True, slots=True)
class ServedModel:
    """What a request's `model` names: the base model, or one of the LoRA adapters served beside it."""

    name: str  # as the reply names it
    lora: LoRARequest | None = None


@dataclass(frozen=True, slots=True)
class Generation:
    engine: EngineClient
    model_name: str
    loras: tuple[LoRARequest, ...] = ()  # served beside the base model, by name

    @property
    def inputs(self) -> InputProcessor:
        return self.engine.inputs

    @property
    def model_names(self) -> list[str]:
        return [self.model_name, *(lora.name for lora in self.loras)]

    def check_model(self, name: str | None) -> ServedModel:
        """The model a request names (None: the base model); any other name is a 404."""
        if name is None or name == self.model_name:
            return ServedModel(self.model_name)
        if (lora := next((lora for lora in self.loras if lora.name == name), None)) is not None:
            return ServedModel(name, lora)
        served = ", ".join(f"`{n}`" for n in self.model_names)
        raise APIError(404, f"The model `{name}` does not exist; this server serves {served}.", "model")

    async def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        tools: ToolCalling | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        messages_field: str = "messages",
    ) -> dict[str, Any]:
        """A conversation (template messages, OpenAI chat's shape) through the chat template, with its tools
        checked and rendered: a prompt dict for start(). A 400 names the field at fault."""
        inputs = self.engine.inputs
        if tools is not None:
            try:
                await self.engine.input_threads.run(lambda: tools.check(inputs.grammars()))
            except ValueError as e:
                raise APIError(400, str(e), param_of(str(e))) from None
        try:
            return await self.engine.input_threads.run(
                inputs.chat, messages, add_generation_prompt, tools, continue_final_message
            )
        except ValueError as e:
            message = str(e)
            field = "continue_final_message" if message.startswith("continue_final_message") else messages_field
            raise APIError(400, message, field) from None

    async def start(
        self,
        prompts: list[Prompt],
        params: SamplingParams | BeamSearchParams,
        renamed: dict[str, str] | None = None,
        model: ServedModel | None = None,
    ) -> list[AsyncIterator[RequestOutput]]:
        """Process every prompt before starting any, so that a bad one leaves nothing running: 503 while draining,
        429 when too many wait, 400 naming the field. `renamed` maps a message's leading field (SamplingParams'
        name) to the one the client sent (its API's name); `model` (check_model's) may run an adapter."""
        try:
            lora = model.lora if model is not None else None
            processed = await self.engine.admit_and_process(prompts, params, lora)
        except ValueError as e:
            message = str(e)
            for ours, theirs in (renamed or {}).items():
                if message.startswith(ours):
                    message = theirs + message[len(ours) :]
                    break
            raise APIError(400, message, param_of(message) or "prompt") from None
        return [self.engine.generate(p) for p in processed]

    async def collect(self, request: Request, streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
        """Each stream's last output, or a 499 (and its requests aborted) when the client leaves first."""
        return await until_disconnected(request, _last_outputs(streams))


async def _last_outputs(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    async def last(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
        out = None
        async for out in stream:
            pass
        return out

    try:
        return list(await asyncio.gather(*(last(s) for s in streams)))
    except RequestFailed as e:
        raise APIError(500, f"the engine failed this request: {e}") from None


async def imported(module: str) -> ModuleType:
    """`module`, imported on a worker thread the first time: the SDK-shaped APIs build their replies with their
    SDK's types (anthropic_reply.py, responses_output.py), tens of MiB resident and up to a second of importing,
    which a server pays only once such a request comes, and without stalling the streams already running."""
    if (loaded := sys.modules.get(module)) is not None:
        return loaded
    return await asyncio.to_thread(importlib.import_module, module)


def params_or_400(make):
    """make(), its ValueError (a message that starts with the field's name) made a 400 naming that field: how every
    API turns its body into SamplingParams or a ToolCalling."""
    try:
        return make()
    except ValueError as e:
        raise APIError(400, str(e), param_of(str(e))) from None


async def until_disconnected(request: Request, coro):
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


async def merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
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


def sse(
    events: AsyncIterator[dict],
    error_event: Callable[[int, str, str | None], dict],
    named: bool = False,
    done: bool = True,
) -> StreamingResponse:
    """Server-sent events: each dict as a `data:` line (`named`: after an `event:` line with its "type", as the
    Responses and Messages APIs send them). A failure once the stream has started is reported in-band as
    error_event(status, message, param), and the server goes on; `done` ends the stream with `data: [DONE]`
    (OpenAI's chat and completions)."""

    def frame(event: dict) -> str:
        data = f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
        return f"event: {event['type']}\n{data}" if named else data

    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield frame(event)
        except APIError as e:
            yield frame(error_event(e.status, e.message, e.param))
        except Exception as e:
            yield frame(error_event(500, str(e), None))
        if done:
            yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")
