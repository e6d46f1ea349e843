"""Counting a request's body as input work while it arrives: it is read on the event loop before any input thread
sees the request, and the step lends a core to that too (engine/executor.py)."""

from __future__ import annotations

from tokenloop.engine.input_threads import InputThreads


class CountInputWork:
    """A POST is input work from its arrival until its body's last part is read (what follows is the input
    threads' to count; the request's own first step must not run on a core fewer). Plain ASGI, like the server's
    other middleware."""

    def __init__(self, app, work: InputThreads) -> None:
        self.app, self.work = app, work

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        reading = True
        self.work.begin()

        async def counted() -> dict:
            nonlocal reading
            message = await receive()
            if reading and not (message["type"] == "http.request" and message.get("more_body", False)):
                reading = False
                self.work.end()
            return message

        try:
            await self.app(scope, counted, send)
        finally:
            if reading:
                self.work.end()
