"""OpenAI's Responses API: POST /v1/responses (streamed as named events or not), GET /v1/responses/{id} of a stored
one. (No DELETE: a second route on the same path makes Starlette's 405 list only the first route's methods.)

A translation, as chat is: the body's items become chat template messages (an earlier stored response's
conversation first), its tools a ToolCalling and its options SamplingParams, all through Generation; the
RequestOutputs come back as output items built with the `openai` package's own types (responses_output.py, imported
on the first request)."""

from __future__ import annotations

import time
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tokenloop.server.errors import ERROR_RESPONSES, APIError
from tokenloop.server.generation import GENERATION_RESPONSES, Generation, imported, params_or_400, sse
from tokenloop.server.response_store import DEFAULT_STORED_RESPONSES, ResponseStore, StoredResponse
from tokenloop.server.responses import ToolCallStream
from tokenloop.server.responses_protocol import ResponsesRequest, template_messages

# Our messages' leading field (SamplingParams' or chat's name) -> the Responses API's.
_RENAMED = {"max_tokens": "max_output_tokens", "structured_outputs.json": "text.format.schema"}


def add_responses_routes(app: FastAPI, generation: Generation, stored: int = DEFAULT_STORED_RESPONSES) -> None:
    store = ResponseStore(stored)

    def checked(make: Callable):
        try:
            return params_or_400(make)
        except APIError as e:
            raise _renamed(e) from None

    def keep(body: ResponsesRequest, history: list[dict], new: list[dict], response: dict) -> None:
        if body.store is not False:
            store.put(response["id"], StoredResponse(response, history + new + template_messages(response["output"])))

    @app.post("/v1/responses", responses=GENERATION_RESPONSES)
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        model = generation.check_model(body.model)
        history: list[dict] = []
        if body.previous_response_id is not None:
            previous = store.get(body.previous_response_id)
            if previous is None:
                message = f"Previous response with id '{body.previous_response_id}' not found."
                raise APIError(404, message, "previous_response_id")
            history = previous.conversation
        new = template_messages(body.items())
        system = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
        tools = checked(body.tool_calling)
        params = checked(lambda: body.sampling_params(tools))
        output = await imported("tokenloop.server.responses_output")
        try:
            prompt = await generation.chat_prompt(system + history + new, tools, messages_field="input")
            streams = await generation.start([prompt], params, _RENAMED, model)
        except APIError as e:
            raise _renamed(e) from None
        meta = {"id": output.new_id("resp"), "created_at": int(time.time()), "model": model.name}
        builder = output.OutputBuilder(ToolCallStream() if tools is not None and tools.constrained else None)
        if body.stream:
            events = output.events(body, meta, builder, streams[0], lambda r: keep(body, history, new, r))
            return sse(events, builder.error_event, named=True, done=False)
        (out,) = await generation.collect(request, streams)
        builder.update(out.outputs[0])
        response = output.response_object(body, meta, builder.items, out)
        keep(body, history, new, response)
        return JSONResponse(response)

    @app.get("/v1/responses/{response_id}", responses=ERROR_RESPONSES)
    async def get_response(response_id: str) -> dict:
        stored = store.get(response_id)
        if stored is None:
            raise APIError(404, f"No response with id '{response_id}' is stored.", "response_id")
        return stored.body


def _renamed(e: APIError) -> APIError:
    """An error from chat's or the engine's checks, in the Responses API's names."""
    message, param = e.message, e.param
    if message.startswith("messages: "):
        message = "input: " + message.removeprefix("messages: ")
    if message.startswith("tools["):  # chat nests a tool's parameters under `function`
        message = message.replace(".function.parameters", ".parameters", 1)
    if message.startswith("text.format"):
        param = "text.format"
    if param in ("prompt", "messages"):
        param = "input"
    return APIError(e.status, message, param, e.headers)
