"""A POST counts as input work while its body arrives; other requests do not count."""

from __future__ import annotations

import asyncio

from tokenloop.engine.input_threads import InputThreads
from tokenloop.server.input_work import CountInputWork


def test_a_post_is_input_work_until_its_body_is_read_and_a_failing_one_ends_too():
    work = InputThreads()
    seen = []
    parts = []

    async def app(scope, receive, send):
        seen.append(("arrived", work.busy))
        while (await receive()).get("more_body"):
            seen.append(("reading", work.busy))
        seen.append(("read", work.busy))
        if scope["path"] == "/fail":
            raise RuntimeError("boom")

    async def send(message):
        pass

    async def receive():
        more = bool(parts and parts.pop())
        return {"type": "http.request", "body": b"{}", "more_body": more}

    async def scenario():
        counted = CountInputWork(app, work)
        parts[:] = [False, True, True]  # popped from the end: two parts with more to come, then the last
        await counted({"type": "http", "method": "POST", "path": "/v1/completions"}, receive, send)
        await counted({"type": "http", "method": "GET", "path": "/health"}, receive, send)
        try:
            await counted({"type": "http", "method": "POST", "path": "/fail"}, receive, send)
        except RuntimeError:
            pass

    asyncio.run(scenario())
    work.shutdown()
    post = [("arrived", 1), ("reading", 1), ("reading", 1), ("read", 0)]
    assert seen == post + [("arrived", 0), ("read", 0)] + [("arrived", 1), ("read", 0)]
    assert work.busy == 0
