"""DisaggregatedEngine: the server's engine when prefill and decode run in worker processes of their own.

The server (server/app.py) sees what it sees of AsyncEngine: admission, prompts processed here on the input
threads, `generate` streaming RequestOutputs. A request whose prompt is long (min_prefill_tokens) goes first to a
prefill worker, which computes it on its own cores and answers with its blocks (disaggregation/worker.py); then to
a decode worker, which copies the blocks it lacks out of the prefill worker's shared memory and runs the request,
streaming its outputs here. A short prompt, or one whose every position is scored (prompt_logprobs), goes to a
decode worker at once. The frontend tells the prefill worker to let the blocks go once they are copied (or the
request is gone). Each step thus runs on one kind of worker: a long prompt no longer holds up every stream.

A worker that dies fails the requests it had with a clear error; the frontend starts it again (its reader thread
waits for the new one to be ready), and `/health` names it meanwhile. With no prefill worker up, prompts go
straight to a decode worker; with no decode worker up, requests fail at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.registry import Collector

from tokenloop.disaggregation.handoff import HandoffStats, KVHandoff
from tokenloop.disaggregation.worker import worker_main
from tokenloop.engine.async_engine import Admission, AsyncEngineConfig, RequestFailed
from tokenloop.engine.beam_search import BeamSearchParams
from tokenloop.engine.client import remote_inputs
from tokenloop.engine.config import EngineConfig
from tokenloop.engine.input_processor import ProcessedPrompt, Prompt
from tokenloop.engine.input_threads import InputThreads
from tokenloop.engine.metrics import EngineMetrics
from tokenloop.engine.shared_pools import remove_pools
from tokenloop.outputs import CompletionOutput, RequestOutput
from tokenloop.sampling.params import SamplingParams

logger = logging.getLogger(__name__)
READY_TIMEOUT_S = 600.0  # a worker loads its model (and may build a compiled package) before it is ready
STOP_TIMEOUT_S = 10.0


def _available_cores() -> list[int]:
    """The CPUs this process may run on (none known where the platform does not say)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


@dataclass(frozen=True, slots=True)
class DisaggregationConfig:
    prefill_workers: int = 1
    decode_workers: int = 1
    prefill_cores: tuple[int, ...] | None = None  # None: the first half of this process's cores
    decode_cores: tuple[int, ...] | None = None  # None: the other half (all of them on one core)
    # A prompt shorter than this is computed by the decode worker itself (llm-d's "selective PD"): its few rows
    # cost the running streams less than its wait behind long prompts at the prefill worker costs it.
    min_prefill_tokens: int = 256

    def __post_init__(self) -> None:
        for name in ("prefill_workers", "decode_workers", "min_prefill_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        available = _available_cores()
        for name in ("prefill_cores", "decode_cores"):
            cores = getattr(self, name)
            if cores is not None and (not cores or (available and not set(cores) <= set(available))):
                raise ValueError(f"{name} must name cores of this machine ({available}), got {list(cores)}")

    def cores(self, role: str, index: int) -> list[int]:
        """The cores of worker `index` of `role`: its kind's cores, shared out among its workers."""
        available = _available_cores() or [0]
        half = max(len(available) // 2, 1)
        given = self.prefill_cores if role == "prefill" else self.decode_cores
        cores = list(given) if given is not None else available[:half] if role == "prefill" else available[-half:]
        count = self.prefill_workers if role == "prefill" else self.decode_workers
        if count <= len(cores):
            return cores[index::count]
        return [cores[index % len(cores)]]


class _Worker:
    """The frontend's side of one worker process."""

    def __init__(self, role: str, index: int) -> None:
        self.role, self.index, self.name = role, index, f"{role}-{index}"
        self.generation = 0
        self.state = "starting"  # "up", "starting" (loading, or restarting after a death), "stopped"
        self.process: multiprocessing.process.BaseProcess | None = None
        self.conn = None
        self.lock = threading.Lock()
        self.flights: set[str] = set()  # requests with work on it
        self.families: list = []  # its engine's latest metrics
        self.pools: str | None = None  # a prefill worker's KV pools' name

    def send(self, *message) -> bool:
        with self.lock:
            if self.conn is None:
                return False
            try:
                self.conn.send(message)
                return True
            except (BrokenPipeError, OSError):
                return False


@dataclass(slots=True)
class _Flight:
    """A request in the frontend: where it runs, and the output waiting for its reader (the newest replaces an
    unread one: outputs are cumulative)."""

    request_id: str
    prompt: ProcessedPrompt
    loop: asyncio.AbstractEventLoop
    ready: asyncio.Event
    arrival: float
    prefill: _Worker | None = None
    decode: _Worker | None = None
    blocks_held: bool = False  # a prefill worker keeps its prompt's blocks: released when handed or when it ends
    prefill_sent: float = 0.0
    prefilled_at: float = 0.0
    latest: RequestOutput | Exception | None = None
    last: RequestOutput | None = None
    finished: bool = False
    tokens: int = 0  # metrics (EngineMetrics.observe_output)
    last_token: float = 0.0


class _HandoffMetrics:
    def __init__(self, r: CollectorRegistry) -> None:
        self.prefill = Histogram(
            "tokenloop_pd_prefill_seconds",
            "A prompt sent to a prefill worker to its blocks ready there (queue and compute)",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40),
            registry=r,
        )
        self.seconds = Histogram(
            "tokenloop_pd_handoff_seconds",
            "A prompt's prefill done to its blocks taken by a decode worker",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=r,
        )
        self.megabytes = Counter("tokenloop_pd_handoff_megabytes", "KV megabytes copied to decode workers", registry=r)
        self.copied = Counter("tokenloop_pd_blocks_copied", "KV blocks copied to decode workers", registry=r)
        self.skipped = Counter(
            "tokenloop_pd_blocks_skipped", "KV blocks not copied: the decode worker held them already", registry=r
        )
        self.queue = Gauge("tokenloop_pd_worker_requests", "Requests with work on a worker", ["worker"], registry=r)
        self.up = Gauge("tokenloop_pd_worker_up", "1 while a worker is up", ["worker"], registry=r)

    def observe(self, stats: HandoffStats, seconds: float) -> None:
        self.seconds.observe(seconds)
        self.megabytes.inc(stats.bytes / 2**20)
        self.copied.inc(stats.copied)
        self.skipped.inc(stats.skipped)


class _WorkerMetrics(Collector):
    """The workers' own engine metrics (running, waiting, KV blocks, speculation), labelled by worker."""

    def __init__(self, workers: list[_Worker]) -> None:
        self.workers = workers

    def collect(self):
        merged = {}
        for worker in self.workers:
            for family in worker.families:
                into = merged.get(family.name)
                if into is None:
                    into = type(family)(family.name, family.documentation, family.type, family.unit)
                    merged[family.name] = into
                for sample in family.samples:
                    labels = dict(sample.labels, worker=worker.name)
                    into.add_sample(sample.name, labels, sample.value, sample.timestamp, sample.exemplar)
        yield from merged.values()


class DisaggregatedEngine(Admission):
    def __init__(
        self, engine_config: EngineConfig, config: DisaggregationConfig, limits: AsyncEngineConfig | None = None
    ) -> None:
        if not engine_config.enable_prefix_caching:
            raise ValueError("disaggregated serving hands blocks over by prefix-cache hash: keep prefix caching on")
        self.engine_config, self.disaggregation = engine_config, config
        self.config = limits or AsyncEngineConfig()
        self.metrics = EngineMetrics()
        self.handoffs = _HandoffMetrics(self.metrics.registry)
        self.draining, self.death, self.on_death = False, None, None
        self.num_waiting = 0
        self._stopping = False
        self._ids = itertools.count()
        self._flights: dict[str, _Flight] = {}
        self._context = multiprocessing.get_context("spawn")  # fork would copy this process's threads' locks
        self.workers = [_Worker("prefill", i) for i in range(config.prefill_workers)]
        self.workers += [_Worker("decode", i) for i in range(config.decode_workers)]
        self.metrics.registry.register(_WorkerMetrics(self.workers))
        try:
            for worker in self.workers:
                self._spawn(worker)
            for worker in self.workers:
                self._wait_ready(worker)
        except BaseException:
            self.shutdown()
            raise
        for worker in self.workers:
            threading.Thread(target=self._read, args=(worker,), name=f"tokenloop-{worker.name}", daemon=True).start()
        self.inputs = remote_inputs(engine_config)
        self.input_threads = InputThreads()
        self.input_threads.submit(self.inputs.warm)

    # -- workers

    def _worker_config(self, worker: _Worker) -> EngineConfig:
        threads = len(self.disaggregation.cores(worker.role, worker.index))
        if worker.role == "decode":
            return replace(self.engine_config, threads=threads)
        worker.pools = f"tokenloop-{os.getpid()}-{worker.name}-{worker.generation}"
        # A prefill step is never a decode-only one: the compiled step would not run there.
        return replace(
            self.engine_config, threads=threads, speculative_config=None, compile=False, kv_shared_memory=worker.pools
        )

    def _spawn(self, worker: _Worker) -> None:
        parent, child = self._context.Pipe()
        cores = self.disaggregation.cores(worker.role, worker.index)
        args = (worker.role, self._worker_config(worker), self.config, cores, child)
        worker.process = self._context.Process(target=worker_main, args=args, name=f"tokenloop-{worker.name}")
        worker.process.start()
        child.close()
        with worker.lock:
            worker.conn = parent

    def _wait_ready(self, worker: _Worker) -> None:
        try:
            if not worker.conn.poll(READY_TIMEOUT_S):
                raise RuntimeError(f"the {worker.name} worker was not ready within {READY_TIMEOUT_S:g} s")
            worker.conn.recv()  # ("ready",)
        except (EOFError, OSError):
            worker.process.join(timeout=STOP_TIMEOUT_S)
            raise RuntimeError(
                f"the {worker.name} worker exited while starting (exit code {worker.process.exitcode}): see its log"
            ) from None
        worker.state = "up"
        self.handoffs.up.labels(worker=worker.name).set(1)

    def _read(self, worker: _Worker) -> None:
        """A worker's reader thread: its messages to the requests' event loops; its death handled, and it is
        started again."""
        while True:
            try:
                message = worker.conn.recv()
            except (EOFError, OSError):
                if self._stopping or not self._restart(worker):
                    return
                continue
            if message[0] == "metrics":
                worker.families = message[1]
                continue
            flight = self._flights.get(message[1])
            if flight is not None:
                flight.loop.call_soon_threadsafe(self._on_message, worker, flight, message)
            elif message[0] == "prefilled":  # its request ended meanwhile
                worker.send("release", message[1])

    def _restart(self, worker: _Worker) -> bool:
        """On its reader thread: fail the dead worker's requests, start a new one; False if it cannot be."""
        worker.state = "starting"
        self.handoffs.up.labels(worker=worker.name).set(0)
        worker.process.join(timeout=STOP_TIMEOUT_S)
        code = worker.process.exitcode
        logger.error("the %s worker died (exit code %s): its requests fail, and it is started again", worker.name, code)
        error = f"the {worker.name} worker died (exit code {code}); it is being restarted"
        for request_id in list(worker.flights):
            if (flight := self._flights.get(request_id)) is not None:
                flight.loop.call_soon_threadsafe(self._fail, flight, RequestFailed(error))
        worker.flights.clear()
        if worker.pools is not None:
            remove_pools(worker.pools)
            for decode in self._of("decode"):
                decode.send("forget", worker.pools)
        worker.generation += 1
        try:
            self._spawn(worker)
            self._wait_ready(worker)
        except Exception:
            logger.exception("the %s worker could not be started again", worker.name)
            worker.state = "stopped"
            return False
        return True

    def _of(self, role: str) -> list[_Worker]:
        return [w for w in self.workers if w.role == role]

    def _pick(self, role: str) -> _Worker | None:
        """The worker of `role` that is up with the fewest requests (None: none is up)."""
        up = [w for w in self._of(role) if w.state == "up"]
        return min(up, key=lambda w: len(w.flights)) if up else None

    def health(self) -> dict:
        workers = {w.name: w.state for w in self.workers}
        return {"status": "ok" if all(s == "up" for s in workers.values()) else "degraded", "workers": workers}

    # -- requests

    @property
    def num_in_flight(self) -> int:
        return len(self._flights)

    async def generate(
        self,
        prompt: Prompt | ProcessedPrompt,
        params: SamplingParams | BeamSearchParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """AsyncEngine.generate's stream, the request run on the workers."""
        request_id = request_id or f"req-{next(self._ids)}"
        self.num_waiting += 1
        started = False
        flight = None
        try:
            if not isinstance(prompt, ProcessedPrompt):
                prompt = await self.input_threads.run(self.inputs.process, prompt, params or SamplingParams())
            loop = asyncio.get_running_loop()
            flight = _Flight(request_id, prompt, loop, asyncio.Event(), time.perf_counter())
            self._flights[request_id] = flight
            self._route(flight)
            while not flight.finished:
                await flight.ready.wait()
                flight.ready.clear()
                item, flight.latest = flight.latest, None
                if isinstance(item, Exception):
                    raise item
                if not started:
                    started = True
                    self.num_waiting -= 1
                flight.finished = item.finished
                yield item
        finally:
            if not started:
                self.num_waiting -= 1
            if flight is not None:
                self._end(flight)

    def _route(self, flight: _Flight) -> None:
        tokens, params = flight.prompt.prompt_token_ids, flight.prompt.params
        scores = isinstance(params, SamplingParams) and params.prompt_logprobs is not None
        prefill = None
        if len(tokens) >= max(self.disaggregation.min_prefill_tokens, self.engine_config.block_size + 1) and not scores:
            prefill = self._pick("prefill")
        if prefill is None:
            self._to_decode(flight, None)
            return
        flight.prefill, flight.blocks_held, flight.prefill_sent = prefill, True, time.perf_counter()
        prefill.flights.add(flight.request_id)
        self._queue_depth(prefill)
        if not prefill.send("prefill", flight.request_id, flight.prompt):
            self._fail(flight, RequestFailed(f"the {prefill.name} worker is gone; it is being restarted"))

    def _to_decode(self, flight: _Flight, handoff: KVHandoff | None) -> None:
        decode = self._pick("decode")
        if decode is None:
            states = ", ".join(f"{w.name} {w.state}" for w in self._of("decode"))
            self._fail(flight, RequestFailed(f"no decode worker is up ({states})"))
            return
        flight.decode = decode
        decode.flights.add(flight.request_id)
        self._queue_depth(decode)
        if not decode.send("decode", flight.request_id, flight.prompt, handoff):
            self._fail(flight, RequestFailed(f"the {decode.name} worker is gone; it is being restarted"))

    def _on_message(self, worker: _Worker, flight: _Flight, message: tuple) -> None:
        """On the request's event loop."""
        kind = message[0]
        if flight.finished or self._flights.get(flight.request_id) is not flight:
            return
        if kind == "prefilled":
            self._leave(worker, flight)
            flight.prefilled_at = time.perf_counter()
            self.handoffs.prefill.observe(flight.prefilled_at - flight.prefill_sent)
            self._to_decode(flight, message[2])
        elif kind == "handed":
            self.handoffs.observe(message[2], time.perf_counter() - flight.prefilled_at)
            self._release(flight)
        elif kind == "output":
            out: RequestOutput = message[2]
            if out.error:
                self._fail(flight, RequestFailed(out.error))
                return
            self.metrics.observe_output(flight, out, time.perf_counter())
            flight.last = out
            self._deliver(flight, out)
        elif kind == "failed":
            self._fail(flight, RequestFailed(message[2]))

    def _deliver(self, flight: _Flight, item: RequestOutput | Exception) -> None:
        flight.latest = item
        flight.ready.set()

    def _fail(self, flight: _Flight, error: Exception) -> None:
        if not flight.finished:
            self._deliver(flight, error)

    def _release(self, flight: _Flight) -> None:
        if flight.blocks_held and flight.prefill is not None:
            flight.blocks_held = False
            flight.prefill.send("release", flight.request_id)

    def _leave(self, worker: _Worker | None, flight: _Flight) -> None:
        if worker is not None:
            worker.flights.discard(flight.request_id)
            self._queue_depth(worker)

    def _queue_depth(self, worker: _Worker) -> None:
        self.handoffs.queue.labels(worker=worker.name).set(len(worker.flights))

    def _end(self, flight: _Flight) -> None:
        """The request's stream is over (finished, failed, or left by its reader): nothing of it stays anywhere."""
        self._flights.pop(flight.request_id, None)
        done = flight.finished and flight.latest is None
        for worker in (flight.prefill, flight.decode):
            if worker is not None and flight.request_id in worker.flights:
                if not done:
                    worker.send("abort", flight.request_id)
                self._leave(worker, flight)
        self._release(flight)

    def abort_all(self) -> None:
        """End every request now, each with a last output whose unfinished completions have finish_reason
        "abort" (the decode workers' own, or one made here for a request not there yet)."""
        for worker in self._of("decode"):
            worker.send("abort_all")
        for flight in list(self._flights.values()):
            if flight.decode is None:
                flight.loop.call_soon_threadsafe(self._deliver, flight, _aborted(flight))

    def shutdown(self) -> None:
        self._stopping = True
        for worker in self.workers:
            worker.send("stop")
        for worker in self.workers:
            if worker.process is not None and worker.process.pid is not None:  # started
                worker.process.join(timeout=STOP_TIMEOUT_S)
                if worker.process.is_alive():
                    worker.process.terminate()
                    worker.process.join(timeout=STOP_TIMEOUT_S)
            if worker.pools is not None:
                remove_pools(worker.pools)
            worker.state = "stopped"
        if hasattr(self, "input_threads"):
            self.input_threads.shutdown()


def _aborted(flight: _Flight) -> RequestOutput:
    prompt = flight.prompt
    n = prompt.params.n if isinstance(prompt.params, SamplingParams) else 1
    outputs = [CompletionOutput(i, "", [], None, None, finish_reason="abort") for i in range(n)]
    return RequestOutput(flight.request_id, prompt.prompt, prompt.prompt_token_ids, outputs, finished=True)
