"""AsyncEngine: the engine's step loop in a background thread, one asyncio stream per request.

The engine itself stays single-threaded: the event loop only queues commands (add, abort) that the step
thread applies between steps, and the step thread hands outputs back with call_soon_threadsafe.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from tokenloop.engine.llm_engine import LLMEngine, Prompt
from tokenloop.engine.metrics import EngineMetrics
from tokenloop.outputs import RequestOutput
from tokenloop.sampling.params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # RequestOutput items, or an Exception that ends the stream
    arrival: float
    last_token: float = 0.0
    tokens: int = 0


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: EngineMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics or EngineMetrics()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._wakeup = threading.Event()
        self._stopping = False
        self._ids = 0
        self._thread = threading.Thread(target=self._run, name="tokenloop-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout=30)

    async def generate(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (cumulative); leaving the iteration early aborts it and frees its blocks."""
        tokenized = self.engine.process_prompt(prompt, params)  # ValueError here, before anything is queued
        if request_id is None:
            self._ids += 1
            request_id = f"req-{self._ids}"
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), time.perf_counter())
        self._streams[request_id] = stream
        self._command("add", request_id, tokenized, params)
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._command("abort", request_id)

    def _command(self, *command) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def _run(self) -> None:
        engine = self.engine
        while not self._stopping:
            self._apply_commands()
            if not engine.has_unfinished_requests():
                self._wakeup.wait()
                self._wakeup.clear()
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # a failed step fails the requests in flight; the server keeps serving
                logger.exception("engine step failed")
                for request_id in list(engine.requests):
                    engine.abort_request(request_id)
                    self._deliver(request_id, RuntimeError(f"the engine failed: {e}"))
                continue
            now = time.perf_counter()
            for out in outputs:
                self._record(out, now)
                self._deliver(out.request_id, out)
            self.metrics.observe_engine(engine)

    def _apply_commands(self) -> None:
        while True:
            try:
                kind, request_id, *args = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "abort":
                self.engine.abort_request(request_id)
                self.metrics.observe_engine(self.engine)
                continue
            try:
                self.engine.add_request(*args, request_id=request_id)
                self.metrics.prompt_tokens.inc(len(args[0]["prompt_token_ids"]))
            except Exception as e:
                self._deliver(request_id, e)

    def _record(self, out: RequestOutput, now: float) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        tokens = sum(len(c.token_ids) for c in out.outputs)
        self.metrics.generation_tokens.inc(tokens - stream.tokens)
        if stream.tokens == 0:
            self.metrics.ttft.observe(now - stream.arrival)
        else:
            self.metrics.itl.observe(now - stream.last_token)
        stream.tokens, stream.last_token = tokens, now
        if out.finished:
            self.metrics.e2e.observe(now - stream.arrival)

    def _deliver(self, request_id: str, item: RequestOutput | Exception) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
