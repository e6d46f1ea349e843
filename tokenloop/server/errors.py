"""Errors for every way a request can fail: bad input (400), key (401), route or model (404), method (405, with
Allow), a body over the limit (413), too many waiting (429, with Retry-After), shutting down or stalled (503), and a
bug (500). In OpenAI's shape, or in the shape of the API a path belongs to (ErrorShapes: Anthropic's for
/v1/messages), whichever part of the server refuses it."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenloop.engine.async_engine import EngineBusy, EngineDraining

logger = logging.getLogger(__name__)

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}
RETRY_AFTER_S = 1


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorDetail


# What every route may answer besides its 200 (for the OpenAPI schema).
ERROR_RESPONSES = {
    status: {"model": ErrorResponse, "description": kind.replace("_", " ")}
    for status, kind in _ERROR_TYPES.items()
    if status != 405
}


class APIError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "error"), "param": param, "code": status}}


ErrorBody = Callable[[int, str, str | None], dict]  # (status, message, param) -> the body


@dataclass(frozen=True, slots=True)
class ErrorShapes:
    """The error body a path answers with: OpenAI's, unless one of `by_prefix` (path prefix, body) claims it."""

    by_prefix: tuple[tuple[str, ErrorBody], ...] = ()

    def body(self, path: str, status: int, message: str, param: str | None = None) -> dict:
        shape = next((shape for prefix, shape in self.by_prefix if path.startswith(prefix)), error_body)
        return shape(status, message, param)

    def response(
        self, path: str, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
    ) -> JSONResponse:
        return _ASCIIJSONResponse(self.body(path, status, message, param), status_code=status, headers=headers)


class _ASCIIJSONResponse(JSONResponse):
    """Escapes everything outside ASCII: an error message may quote text that is not encodable as UTF-8."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def param_of(message: str) -> str | None:
    """Our ValueErrors start with the offending field's name ("temperature must be ...",
    "structured_outputs.regex: ...")."""
    first = re.match(r"[A-Za-z_]\w*(?=[ :.\[]|$)", message)  # "tools[0].function.parameters: ..." names tools
    return first.group() if first and first.group() not in ("the", "a", "prompt") else None


class CatchAll:
    """Any exception that escapes a route becomes a JSON 500, and the connection stays usable. Plain ASGI: under
    Starlette's ServerErrorMiddleware the exception would be re-raised to uvicorn, which then drops the
    keep-alive connection without saying `Connection: close`."""

    def __init__(self, app, shapes: ErrorShapes) -> None:
        self.app, self.shapes = app, shapes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as e:
            logger.exception("request to %s failed", scope.get("path"))
            if started:  # too late for a status: the connection must close, as HTTP has no other way to say it
                raise
            await self.shapes.response(scope["path"], 500, f"internal error: {type(e).__name__}: {e}")(
                scope, receive, send
            )


def install_error_handlers(app: FastAPI, shapes: ErrorShapes) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return shapes.response(request.url.path, e.status, e.message, e.param, e.headers)

    @app.exception_handler(EngineBusy)
    async def _busy(request: Request, e: EngineBusy) -> JSONResponse:
        message, headers = f"too many requests: {e}; retry later", {"Retry-After": str(RETRY_AFTER_S)}
        return shapes.response(request.url.path, 429, message, None, headers)

    @app.exception_handler(EngineDraining)
    async def _draining(request: Request, e: EngineDraining) -> JSONResponse:
        return shapes.response(request.url.path, 503, str(e), None, {"Connection": "close"})

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
            return shapes.response(request.url.path, status, message, param)

        err = e.errors()[0] if e.errors() else {}
        if err.get("type") == "json_invalid":  # its loc is a character offset, not a field
            return error_response(400, f"invalid JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}")
        loc = [str(part) for part in err.get("loc", ()) if part != "body"]
        if not loc and err.get("type") == "value_error":  # a check over the whole body: "FIELD: what is wrong"
            message = str(err.get("ctx", {}).get("error", err.get("msg")))
            head = message.split(":", 1)[0]
            return error_response(400, message, head if head.isidentifier() and head != "body" else None)
        message = f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid request')}"
        return error_response(400, message, loc[0] if loc else None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        headers = e.headers
        if e.status_code == 405:  # Starlette names the methods of the first route on the path; there may be more
            path = request.url.path
            methods = {
                m for r in app.routes if getattr(r, "methods", None) and r.path_regex.match(path) for m in r.methods
            }
            headers = (headers or {}) | {"Allow": ", ".join(sorted(methods))}
        return shapes.response(request.url.path, e.status_code, str(e.detail), None, headers)
