"""A bound on request bodies: past it, a 413 in the path's error shape, without reading the rest of the body.

A declared Content-Length over the bound is refused before a byte of the body is read; a chunked body is counted
as it arrives and refused as soon as it crosses the bound. Plain ASGI, like the server's other middleware.
"""

from __future__ import annotations

from tokenloop.server.errors import ErrorShapes

DEFAULT_MAX_BODY_MB = 8.0


class LimitBody:
    def __init__(self, app, max_bytes: int, shapes: ErrorShapes) -> None:
        self.app, self.max_bytes, self.shapes = app, max_bytes, shapes

    def _refusal(self, path: str):
        return self.shapes.response(
            path,
            413,
            f"the request body is larger than the server's limit of {self.max_bytes} bytes (--max-body-mb)",
            headers={"Connection": "close"},
        )

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refusal(scope["path"])(scope, receive, send)
            return
        if declared is not None:  # the server (h11) stops the body at its declared length
            await self.app(scope, receive, send)
            return
        # No length declared (chunked): read up to the limit before the app sees any of it, as it would read the
        # whole body anyway; past the limit, refuse without reading on.
        messages, received = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                await self._refusal(scope["path"])(scope, receive, send)
                return
            if not message.get("more_body", False):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)
