"""AsyncEngine: the engine's step loop in a background thread, one asyncio stream per request.

The engine itself stays single-threaded: the event loop only queues commands (add, abort, pause, resume) that
the step thread applies between steps, and the step thread hands each step's outputs back with one call_soon_threadsafe.
What comes before a request is queued (chat templates, tokenizing, grammars, checks: engine/input_processor.py)
runs on input threads of lower CPU priority (engine/input_threads.py), so that neither the event loop nor the step
waits for it.

What one request can cost the others is bounded here: requests waiting for their first token are capped
(`max_waiting`), a stream holds one output however far its reader lags (outputs are cumulative, so the newest
replaces the older), and a request whose reader has not taken `max_unread_outputs` outputs is paused (out of
the batch, its KV blocks kept) until the reader catches up, or aborted after `unread_timeout_s`.

If the step thread itself dies (a bug outside any one request's step), every open stream ends with an error,
new requests are refused, `healthy()` turns false and `on_death` is called, so that the server can exit for a
supervisor to restart it: nothing waits forever on a loop that is gone.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from tokenloop.engine.beam_search import BeamSearchParams
from tokenloop.engine.config import EngineConfig
from tokenloop.engine.input_processor import InputProcessor, ProcessedPrompt, Prompt
from tokenloop.engine.input_threads import InputThreads
from tokenloop.engine.llm_engine import LLMEngine
from tokenloop.engine.lora import LoRARequest
from tokenloop.engine.metrics import EngineMetrics
from tokenloop.engine.requests import Fork
from tokenloop.outputs import RequestOutput
from tokenloop.sampling.params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class AsyncEngineConfig:
    max_waiting: int = 256  # requests admitted and waiting for their first token; beyond it, EngineBusy
    max_unread_outputs: int = 32  # outputs a reader may leave untaken before its request is paused
    unread_timeout_s: float = 300.0  # a request paused this long for its reader is aborted
    stall_timeout_s: float = 4.0  # a step loop silent this long is reported unhealthy

    def __post_init__(self) -> None:
        for name in ("max_waiting", "max_unread_outputs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("unread_timeout_s", "stall_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


class EngineBusy(Exception):
    """Too many requests are waiting: try again later."""


class EngineDraining(Exception):
    """The server is shutting down and takes no new request."""


class RequestFailed(Exception):
    """The engine failed this request (alone, or with the whole batch when the forward pass failed)."""


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    ready: asyncio.Event  # set when `latest` holds something
    arrival: float
    latest: RequestOutput | Exception | None = None  # the newest output not yet taken
    delivered: int = 0  # outputs put, counted on the event loop
    taken: int = 0  # `delivered` as of the reader's last take
    paused_at: float | None = None  # when its request was paused for the reader (monotonic), None if running
    started: bool = False  # has had its first output (no longer waiting)
    last_token: float = 0.0  # metrics, kept by the step thread
    tokens: int = 0


class Admission:
    """What a server's engine does before a request runs, whatever runs it (AsyncEngine here, or the frontend of
    disaggregated workers): admission against max_waiting, and prompts processed on the input threads."""

    config: AsyncEngineConfig
    inputs: InputProcessor
    input_threads: InputThreads
    num_waiting: int  # requests admitted, no output yet (event loop side), their prompts processed or not
    draining: bool
    death: BaseException | None

    async def admit_and_process(
        self, prompts: list[Prompt], params: SamplingParams | BeamSearchParams, lora: LoRARequest | None = None
    ) -> list[ProcessedPrompt]:
        """Admit len(prompts) requests (EngineDraining, EngineBusy), then process every prompt on an input thread
        before any is queued (ValueError for a bad one); they count as waiting meanwhile."""
        self.admit(len(prompts))
        self.num_waiting += len(prompts)
        try:
            return await self.input_threads.run(lambda: [self.inputs.process(p, params, lora) for p in prompts])
        finally:
            self.num_waiting -= len(prompts)

    def admit(self, num_requests: int) -> None:
        """Raise EngineDraining or EngineBusy unless `num_requests` more requests may wait."""
        if self.death is not None:
            raise EngineDraining(self._death_message())
        if self.draining:
            raise EngineDraining("the server is shutting down")
        if self.num_waiting + num_requests > self.config.max_waiting:
            raise EngineBusy(f"{self.num_waiting} requests are waiting already (at most {self.config.max_waiting})")

    def _death_message(self) -> str:
        return f"the engine's step loop died ({self.death!r}); the server is exiting"


class AsyncEngine(Admission):
    """The engine is built on the step thread and runs there: every torch op of the server runs on that one
    thread. OpenMP (libgomp) gives each thread that starts parallel work its own team of threads, and once a
    process holds more of them than it has cores, their threads barely spin between parallel regions but sleep
    and are woken for each of the hundreds a step makes: with the model loaded on the main thread and stepped on
    another, a step of 32 sequences took half as long again."""

    def __init__(
        self,
        engine_config: EngineConfig,
        metrics: EngineMetrics | None = None,
        config: AsyncEngineConfig | None = None,
        on_death: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.metrics = metrics or EngineMetrics()
        self.config = config or AsyncEngineConfig()
        self.on_death = on_death  # called on the step thread if it dies
        self.death: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._wakeup = threading.Event()
        self._stopping = False
        self.draining = False
        self.num_waiting = 0  # requests admitted, no output yet (event loop side), their prompts processed or not
        self._ids = 0
        self._heartbeat = time.monotonic()  # the step loop's last sign of life
        self.engine: LLMEngine  # set by the step thread, and used there only
        self.input_threads = InputThreads()
        built: queue.SimpleQueue = queue.SimpleQueue()  # None once self.engine is set, or why it could not be built
        self._thread = threading.Thread(
            target=self._run, args=(engine_config, built), name="tokenloop-engine", daemon=True
        )
        self._thread.start()
        if (error := built.get()) is not None:
            raise error
        self.inputs: InputProcessor = self.engine.input_processor  # thread-safe: used on the input threads
        self.input_threads.submit(self.inputs.warm)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def healthy(self) -> bool:
        """The step loop is alive and has not been stuck in one step (or command) for stall_timeout_s."""
        alive = self.death is None and self._thread.is_alive()
        return alive and time.monotonic() - self._heartbeat < self.config.stall_timeout_s

    def health(self) -> dict:
        return {"status": "ok" if self.healthy() else "stalled"}

    def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout=30)
        self.input_threads.shutdown()

    def abort_all(self) -> None:
        """End every request now: each stream gets a last output, unfinished completions with finish_reason "abort"."""
        self._command("abort_all", None)

    async def generate(
        self,
        prompt: Prompt | ProcessedPrompt,
        params: SamplingParams | BeamSearchParams | None = None,
        request_id: str | None = None,
        retain: bool = False,
        before_add: Callable[[LLMEngine], None] | None = None,
        fork_of: Fork | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (cumulative; a slow reader skips the ones superseded meanwhile). Leaving
        the iteration early aborts it and frees its blocks. A prompt not yet processed is, first (a ValueError
        then, before anything is queued). `retain` and `fork_of`: LLMEngine.add_request's; `before_add` runs on the
        step thread just before the request is queued (a decode worker copies its prompt's KV blocks in there)."""
        if request_id is None:
            self._ids += 1
            request_id = f"req-{self._ids}"
        stream = _Stream(asyncio.get_running_loop(), asyncio.Event(), time.perf_counter())
        self._streams[request_id] = stream
        self.num_waiting += 1
        finished = False
        try:
            if not isinstance(prompt, ProcessedPrompt):
                prompt = await self.input_threads.run(self.inputs.process, prompt, params or SamplingParams())
            self._command("add", request_id, prompt, retain, before_add, fork_of)
            if self.death is not None:  # died before this stream was there to be told
                self._put(request_id, stream, self._death_error())
            while not finished:
                await stream.ready.wait()
                stream.ready.clear()
                item, stream.latest = stream.latest, None
                stream.taken = stream.delivered
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
                if stream.paused_at is not None:  # the reader is back for more
                    stream.paused_at = None
                    self._command("resume", request_id)
        finally:
            self._streams.pop(request_id, None)
            if not stream.started:
                self.num_waiting -= 1
            if not finished:
                self._command("abort", request_id)

    def _put(self, request_id: str, stream: _Stream, item: RequestOutput | Exception) -> None:
        """On the event loop: hand an output to its stream, pausing the request if its reader lags."""
        if self._streams.get(request_id) is not stream:
            return
        if not stream.started:
            stream.started = True
            self.num_waiting -= 1
        stream.latest, stream.delivered = item, stream.delivered + 1
        stream.ready.set()
        if stream.paused_at is None and stream.delivered - stream.taken >= self.config.max_unread_outputs:
            stream.paused_at = paused_at = time.monotonic()
            self._command("pause", request_id)
            stream.loop.call_later(self.config.unread_timeout_s, self._unread_timeout, request_id, stream, paused_at)

    def _unread_timeout(self, request_id: str, stream: _Stream, paused_at: float) -> None:
        if self._streams.get(request_id) is stream and stream.paused_at == paused_at:
            self._command("abort", request_id)
            message = f"aborted: the client read nothing for {self.config.unread_timeout_s:g} s"
            stream.latest = RequestFailed(message)
            stream.ready.set()

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """fn(engine) run on the step thread between two steps; its result, or its exception raised here."""
        future = asyncio.get_running_loop().create_future()
        self._command("call", None, future, fn)
        return await future

    @staticmethod
    def _settle(future: asyncio.Future, fn: Callable[[LLMEngine], Any], engine: LLMEngine) -> None:
        try:
            result, error = fn(engine), None
        except Exception as e:  # noqa: BLE001 — handed to the caller
            result, error = None, e

        def settle() -> None:
            if not future.done():
                future.set_exception(error) if error is not None else future.set_result(result)

        future.get_loop().call_soon_threadsafe(settle)

    def _command(self, *command) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def _run(self, engine_config: EngineConfig, built: queue.SimpleQueue) -> None:
        try:
            self.engine = engine = LLMEngine(engine_config)
        except BaseException as e:  # noqa: BLE001 — handed to the constructor, which raises it
            built.put(e)
            return
        built.put(None)
        try:
            self._loop(engine)
        except BaseException as e:
            self._died(e)

    def _death_error(self) -> RequestFailed:
        return RequestFailed(self._death_message())

    def _died(self, e: BaseException) -> None:
        logger.critical("the engine's step loop died", exc_info=e)
        self.death = e
        self._deliver_all([(request_id, self._death_error()) for request_id in list(self._streams)])
        if self.on_death is not None:
            self.on_death(e)

    def _loop(self, engine: LLMEngine) -> None:
        while not self._stopping:
            self._heartbeat = time.monotonic()
            self._apply_commands()
            if not engine.has_unfinished_requests():
                self._wakeup.wait(timeout=self.config.stall_timeout_s / 4)  # wakes to keep the heartbeat fresh
                self._wakeup.clear()
                continue
            engine.executor.lend_cores(1 if self.input_threads.busy else 0)  # the input threads' work takes one
            try:
                outputs = engine.step()
            except Exception as e:  # a failure no request could be blamed for: fail those in flight, go on serving
                logger.exception("engine step failed")
                for request_id in list(engine.requests):
                    engine.abort_request(request_id)
                    self._deliver(request_id, RequestFailed(f"the engine failed: {e}"))
                continue
            now = time.perf_counter()
            for out in outputs:
                self._record(out, now)
            self._deliver_all([(out.request_id, RequestFailed(out.error) if out.error else out) for out in outputs])
            self.metrics.observe_engine(engine)

    def _apply_commands(self) -> None:
        engine = self.engine
        while True:
            try:
                kind, request_id, *args = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                if kind == "add":
                    prompt, retain, before_add, fork_of = args
                    if before_add is not None:
                        before_add(engine)
                    engine.add_request(prompt, request_id=request_id, retain=retain, fork_of=fork_of)
                    self.metrics.prompt_tokens.inc(len(prompt.prompt_token_ids))
                elif kind == "call":
                    future, fn = args
                    self._settle(future, fn, engine)
                elif kind == "abort":
                    engine.abort_request(request_id)
                elif kind == "abort_all":
                    for rid in list(engine.requests):
                        self._deliver(rid, engine.abort_request(rid))
                elif kind == "pause":
                    engine.pause_request(request_id)
                elif kind == "resume":
                    engine.resume_request(request_id)
            except Exception as e:
                logger.exception("engine command %s failed", kind)
                self._deliver(request_id, e)
            self.metrics.observe_engine(engine)

    def _record(self, out: RequestOutput, now: float) -> None:
        if (stream := self._streams.get(out.request_id)) is not None:
            self.metrics.observe_output(stream, out, now)

    def _deliver(self, request_id: str | None, item: RequestOutput | Exception) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items: list[tuple[str | None, RequestOutput | Exception]]) -> None:
        """Hand outputs to their streams' event loops, in one call per loop: each call wakes the loop (a write to
        its pipe), and a wake-up per stream and step took a core from the step's threads 32 times a step."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[str, _Stream, RequestOutput | Exception]]] = {}
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((request_id, stream, item))
        for loop, batch in by_loop.items():
            loop.call_soon_threadsafe(self._put_all, batch)

    def _put_all(self, batch: list[tuple[str, _Stream, RequestOutput | Exception]]) -> None:
        for request_id, stream, item in batch:
            self._put(request_id, stream, item)
