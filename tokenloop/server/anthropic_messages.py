"""Anthropic's Messages API: POST /v1/messages (a message, or its stream of named events) and
POST /v1/messages/count_tokens, and Anthropic's error shape for every refusal under /v1/messages.

A translation onto the Generation seam, as OpenAI's chat is: the body becomes chat messages and a ToolCalling
(anthropic_protocol.py), the reply is built from the `anthropic` package's own types (anthropic_reply.py, imported
on the first request). Usage follows Anthropic's meaning: input_tokens + cache_read_input_tokens is the prompt
(what count_tokens says), the part read from the prefix cache counted apart.
"""

from __future__ import annotations

from typing import Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from tokenloop.sampling.params import SamplingParams
from tokenloop.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from tokenloop.server.errors import APIError
from tokenloop.server.generation import Generation, imported, params_or_400, sse
from tokenloop.tools.calling import ToolCalling

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
        from anthropic.types import MessageTokensCount  # the SDK's type, imported once a client asks for the schema

        components["MessageTokensCount"] = MessageTokensCount.model_json_schema(mode="serialization")
        ok = schema["paths"]["/v1/messages/count_tokens"]["post"]["responses"]["200"]
        ok["content"] = {"application/json": {"schema": {"$ref": "#/components/schemas/MessageTokensCount"}}}
        return schema

    app.openapi = openapi

    @app.post("/v1/messages", responses=_MESSAGE_RESPONSES)
    async def messages(body: MessagesRequest, request: Request) -> Response:
        """Anthropic's Messages API: a reply to the conversation, streamed as named events with stream: true."""
        model = generation.check_model(body.model)
        tools, prompt = await _prompt(generation, body)
        anthropic_reply = await imported("tokenloop.server.anthropic_reply")
        streams = await generation.start([prompt], _sampling_params(body, tools), _RENAMED, model)
        reply = anthropic_reply.Reply(model.name, body.stop_sequences or [], tools is not None and tools.constrained)
        if body.stream:
            return sse(anthropic_reply.events(streams[0], reply), anthropic_error_body, named=True, done=False)
        (out,) = await generation.collect(request, streams)
        return JSONResponse(anthropic_reply.dump(reply.message(out)))

    @app.post("/v1/messages/count_tokens", responses=_ERRORS | {200: {"description": "the prompt's token count"}})
    async def count_tokens(body: CountTokensRequest) -> JSONResponse:
        """The prompt's tokens, tools included: a message's usage input_tokens + cache_read_input_tokens."""
        generation.check_model(body.model)
        _, prompt = await _prompt(generation, body)
        anthropic_reply = await imported("tokenloop.server.anthropic_reply")
        return JSONResponse(anthropic_reply.token_count(len(prompt["prompt_token_ids"])))


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
