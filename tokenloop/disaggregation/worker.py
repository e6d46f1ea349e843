"""A prefill or decode worker: one process, one engine (AsyncEngine), pinned to its cores, driven over a pipe.

Messages in (from the frontend): ("prefill", id, ProcessedPrompt), ("decode", id, ProcessedPrompt, KVHandoff or
None), ("release", id), ("abort", id), ("abort_all",), ("forget", pools), ("stop",). Out: ("ready",),
("prefilled", id, KVHandoff), ("handed", id, HandoffStats), ("output", id, RequestOutput), ("failed", id,
message), ("metrics", families). Only small things cross the pipe: token ids, parameters, block ids; a prompt's
K/V stays in shared memory (disaggregation/handoff.py).

A prefill worker computes a prompt (one greedy token, its blocks retained) and hands over its full blocks; a
decode worker takes them (take_blocks, on its step thread, just before the request is queued) and runs the
request as colocated serving would, computing only the prompt's last, partial block.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from dataclasses import replace
from multiprocessing.connection import Connection

from tokenloop.disaggregation.handoff import HandoffStats, KVHandoff, PeerPools, take_blocks
from tokenloop.engine.async_engine import AsyncEngine, AsyncEngineConfig, RequestFailed
from tokenloop.engine.block_manager import BlockManager
from tokenloop.engine.config import EngineConfig
from tokenloop.engine.input_processor import ProcessedPrompt
from tokenloop.engine.shared_pools import remove_pools
from tokenloop.sampling.params import SamplingParams

logger = logging.getLogger(__name__)
METRICS_INTERVAL_S = 1.0
# The frontend shows these from its own view (the client's): a worker's would count a request twice.
FRONTEND_METRICS = ("time_to_first_token", "inter_token_latency", "e2e_request_latency", "prompt_tokens", "generation")


def worker_main(role: str, config: EngineConfig, limits: AsyncEngineConfig, cores: list[int], conn: Connection) -> None:
    """The worker process's entry (multiprocessing, spawn)."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s {role} %(name)s: %(message)s")
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)
    try:
        asyncio.run(Worker(role, config, limits, conn).serve())
    finally:
        if config.kv_shared_memory is not None:
            remove_pools(config.kv_shared_memory)


class Worker:
    def __init__(self, role: str, config: EngineConfig, limits: AsyncEngineConfig, conn: Connection) -> None:
        self.role, self.config, self.limits, self.conn = role, config, limits, conn
        self.tasks: dict[str, asyncio.Task] = {}
        self.background: set[asyncio.Task] = set()  # releases and forgets under way
        self.peers = PeerPools()

    async def serve(self) -> None:
        self.engine = AsyncEngine(self.config, config=self.limits)
        self.loop = asyncio.get_running_loop()
        self.stopped = asyncio.Event()
        self.conn.send(("ready",))
        threading.Thread(target=self._read, name="tokenloop-worker-pipe", daemon=True).start()
        metrics = asyncio.create_task(self._send_metrics())
        await self.stopped.wait()
        metrics.cancel()
        for task in list(self.tasks.values()):
            task.cancel()
        self.engine.shutdown()

    def _read(self) -> None:
        """The pipe's reader thread: each message to the event loop; the frontend gone, the worker stops."""
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                message = ("stop",)
            self.loop.call_soon_threadsafe(self._dispatch, message)
            if message[0] == "stop":
                return

    def _send(self, *message) -> None:
        try:
            self.conn.send(message)
        except (BrokenPipeError, OSError):  # the frontend is gone: the reader stops the worker
            pass

    def _dispatch(self, message: tuple) -> None:
        kind, *args = message
        if kind == "stop":
            self.stopped.set()
        elif kind == "prefill":
            self._start(args[0], self._prefill(*args))
        elif kind == "decode":
            self._start(args[0], self._decode(*args))
        elif kind == "release":
            self._background(self.engine.call(lambda llm: llm.release_request(args[0])))
        elif kind == "abort" and (task := self.tasks.get(args[0])) is not None:
            task.cancel()  # leaving engine.generate aborts the request
        elif kind == "abort_all":
            self.engine.abort_all()
        elif kind == "forget":  # a prefill worker died: its pools' files are gone
            self._background(self.engine.call(lambda llm: self.peers.forget(args[0])))

    def _background(self, work) -> None:
        """Run `work` on the loop, held until done (the loop keeps only weak references to its tasks)."""
        task = self.loop.create_task(work)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    def _start(self, request_id: str, work) -> None:
        async def run() -> None:
            try:
                await work
            except asyncio.CancelledError:
                pass
            except (RequestFailed, ValueError) as e:
                self._send("failed", request_id, str(e))
            except Exception as e:  # noqa: BLE001 — the request fails, the worker goes on
                logger.exception("request %s failed", request_id)
                self._send("failed", request_id, f"the {self.role} worker failed: {e}")
            finally:
                self.tasks.pop(request_id, None)

        self.tasks[request_id] = self.loop.create_task(run())

    async def _prefill(self, request_id: str, prompt: ProcessedPrompt) -> None:
        """The prompt's K/V, by one greedy token, its blocks kept until the frontend releases them."""
        params = SamplingParams(temperature=0, max_tokens=1)
        prompt = replace(prompt, params=params)
        async for out in self.engine.generate(prompt, request_id=request_id, retain=True):
            if out.error:
                raise RequestFailed(out.error)
        blocks = await self.engine.call(lambda llm: llm.retained_blocks(request_id))
        # A decode worker computes the prompt's last token whatever it finds cached: a block ending there is not taken.
        blocks = blocks[: (len(prompt.prompt_token_ids) - 1) // self.config.block_size]
        self._send("prefilled", request_id, KVHandoff(self.config.kv_shared_memory, blocks))

    async def _decode(self, request_id: str, prompt: ProcessedPrompt, handoff: KVHandoff | None) -> None:
        before_add = None
        if handoff is not None:

            def before_add(llm) -> None:  # on the step thread
                lora = llm.loras.slot(prompt.lora_request) if prompt.lora_request is not None else None
                try:
                    stats = take_blocks(llm, self.peers, handoff, prompt.prompt_token_ids, BlockManager.lora_key(lora))
                except Exception:  # the request computes its prompt itself
                    logger.exception("taking %s's blocks from %s failed", request_id, handoff.pools)
                    self.peers.forget(handoff.pools)
                    stats = HandoffStats()
                self.loop.call_soon_threadsafe(self._send, "handed", request_id, stats)

        async for out in self.engine.generate(prompt, request_id=request_id, before_add=before_add):
            self._send("output", request_id, out)

    async def _send_metrics(self) -> None:
        while True:
            families = [
                family
                for family in self.engine.metrics.registry.collect()
                if not any(name in family.name for name in FRONTEND_METRICS)
            ]
            self._send("metrics", families)
            await asyncio.sleep(METRICS_INTERVAL_S)
