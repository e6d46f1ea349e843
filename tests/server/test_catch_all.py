"""A bug that escapes a route is a JSON 500 in OpenAI's shape, and the next request on the app is served."""

from __future__ import annotations

import asyncio

import httpx
from fastapi import FastAPI

from tokenloop.server.errors import CatchAll, ErrorShapes, install_error_handlers


def test_an_exception_escaping_a_route_is_a_json_500():
    app = FastAPI()
    install_error_handlers(app, ErrorShapes())
    app.add_middleware(CatchAll, shapes=ErrorShapes())

    @app.get("/boom")
    async def boom():
        raise KeyError("lost")

    @app.get("/fine")
    async def fine():
        return {"ok": True}

    async def scenario():
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app, raise_app_exceptions=True), base_url="http://app"
        ) as client:
            return await client.get("/boom"), await client.get("/fine")

    failed, served = asyncio.run(scenario())
    assert failed.status_code == 500 and failed.headers["content-type"] == "application/json"
    error = failed.json()["error"]
    assert error["type"] == "internal_server_error" and "KeyError" in error["message"]
    assert served.status_code == 200 and served.json() == {"ok": True}
