"""The HTTP server: builds the app, its middleware and error shapes, and registers each API's routes (one module per
API: tokenize, completions, chat, responses, Anthropic's messages); serves /v1/models, /health and /metrics itself."""

from __future__ import annotations

import time

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from tokenloop.engine.async_engine import AsyncEngine
from tokenloop.engine.client import EngineClient
from tokenloop.engine.lora import LoRARequest
from tokenloop.explorer.routes import add_explorer_routes, explore_openapi
from tokenloop.server.anthropic_messages import add_messages_routes, anthropic_error_body
from tokenloop.server.body_limit import DEFAULT_MAX_BODY_MB, LimitBody
from tokenloop.server.chat import add_chat_routes
from tokenloop.server.completions import add_completions_routes
from tokenloop.server.errors import (
    ERROR_RESPONSES,
    CatchAll,
    ErrorShapes,
    install_error_handlers,
)
from tokenloop.server.generation import Generation
from tokenloop.server.input_work import CountInputWork
from tokenloop.server.openai_responses import add_responses_routes
from tokenloop.server.openai_shared import Bounds
from tokenloop.server.schema_bounds import integer_schemas, token_lists
from tokenloop.server.tokenize import add_tokenizer_routes

DEFAULT_MAX_N = 128  # OpenAI's own bound on n


class Health(BaseModel):
    status: str  # "ok", "stalled" (the step loop is stuck or dead), "degraded" (a worker is down) or "draining"
    workers: dict[str, str] | None = None  # with --disaggregate: each worker's state ("up", "starting", "stopped")


class _RequireAPIKey:
    """401 on /v1 and /explore/api routes without 'Authorization: Bearer KEY' or 'x-api-key: KEY' (Anthropic's
    header). Plain ASGI on purpose: under Starlette's BaseHTTPMiddleware (@app.middleware) Request.is_disconnected()
    never turns true, so a non-streamed request whose client left would run to its end."""

    def __init__(self, app, api_key: str, shapes: ErrorShapes) -> None:
        self.app, self.bearer, self.key, self.shapes = app, f"Bearer {api_key}".encode(), api_key.encode(), shapes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(("/v1", "/explore/api")):
            headers = dict(scope["headers"])
            if headers.get(b"authorization") != self.bearer and headers.get(b"x-api-key") != self.key:
                await self.shapes.response(scope["path"], 401, "invalid or missing API key")(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(
    engine: EngineClient,
    model_name: str,
    api_key: str | None = None,
    max_n: int = DEFAULT_MAX_N,
    max_body_mb: float = DEFAULT_MAX_BODY_MB,
    loras: tuple[LoRARequest, ...] = (),
) -> FastAPI:
    """`loras`: adapters the engine has loaded (EngineConfig.lora_modules), served by name beside `model_name`."""
    app = FastAPI(title="tokenloop", docs_url=None, redoc_url=None)
    generation = Generation(engine, model_name, tuple(loras))
    inputs = engine.inputs  # prompts are processed on the engine's input threads (engine.input_threads)
    max_model_len = inputs.max_model_len
    shapes = ErrorShapes(by_prefix=(("/v1/messages", anthropic_error_body),))
    install_error_handlers(app, shapes)
    if api_key is not None:
        app.add_middleware(_RequireAPIKey, api_key=api_key, shapes=shapes)
    app.add_middleware(LimitBody, max_bytes=int(max_body_mb * 2**20), shapes=shapes)
    app.add_middleware(CountInputWork, work=engine.input_threads)
    app.add_middleware(CatchAll, shapes=shapes)  # added last: outermost, it also covers the key check and body limit
    bounds = Bounds.of(max_n, max_model_len)
    app.openapi = lambda: _openapi(app, bounds.maxima(), max_model_len, inputs.vocab_size)

    @app.get("/health", response_model=Health, responses={503: {"model": Health, "description": "stalled or draining"}})
    async def health() -> JSONResponse:
        """200 while the step loop is alive and making progress (every worker up); 503 when it is stuck or dead, a
        worker is down, or the server drains."""
        body = engine.health() | ({"status": "draining"} if engine.draining else {})
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

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
        """The base model, then its LoRA adapters, each with the base as `parent` (as vLLM lists them)."""
        created = int(time.time())
        card = {"object": "model", "created": created, "owned_by": "tokenloop", "max_model_len": max_model_len}
        adapters = [card | {"id": lora.name, "root": lora.path, "parent": model_name} for lora in loras]
        return {"object": "list", "data": [card | {"id": model_name}, *adapters]}

    add_tokenizer_routes(app, engine, generation.check_model)
    add_completions_routes(app, generation, bounds)
    add_chat_routes(app, generation, bounds)
    add_responses_routes(app, generation)
    add_messages_routes(app, generation)
    if isinstance(engine, AsyncEngine):  # the explorer forks and reads one engine's sequences between its steps
        add_explorer_routes(app, engine)
    return app


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
                    for integer in integer_schemas(schema_of_field):
                        integer["maximum"] = bounds[field]
        prompt = components["CompletionRequest"]["properties"]["prompt"]
        token_fields = [prompt, components["DetokenizeRequest"]["properties"]["tokens"]] + [
            components[name]["properties"]["allowed_token_ids"]
            for name in ("CompletionRequest", "ChatCompletionRequest")
        ]
        for integer in (i for field in token_fields for i in integer_schemas(field)):
            integer["maximum"] = vocab_size - 1
        for token_list in token_lists(prompt):
            token_list["maxItems"] = max_model_len - 1
        if "ExploreParams" in components:
            explore_openapi(schema, vocab_size)
        app.openapi_schema = schema
    return app.openapi_schema
