"""EngineReplica: one engine (AsyncEngine, its step loop in a thread) as a Ray Serve replica.

It streams a processed request's outputs, and reports to the routers (record_routing_stats) the chain hashes of the
blocks in its prefix cache, read on its step thread, with its requests in flight.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator

from tokenloop.engine.async_engine import AsyncEngine, AsyncEngineConfig
from tokenloop.engine.config import EngineConfig
from tokenloop.engine.input_processor import ProcessedPrompt
from tokenloop.outputs import RequestOutput


def replica_threads(config: EngineConfig, replicas: int) -> int:
    """Each replica's threads (and the CPUs it asks Ray for): --threads, else this machine's cores shared out."""
    return config.threads or max(1, (os.cpu_count() or 1) // replicas)


class EngineReplica:
    def __init__(self, engine_config: EngineConfig, limits: AsyncEngineConfig) -> None:
        self.engine = AsyncEngine(engine_config, config=limits)

    async def generate(self, prompt: ProcessedPrompt, block_hashes=None, route=None) -> AsyncIterator[RequestOutput]:
        """The request's outputs, streamed (block_hashes and route are for the router: scale_out/routers.py).
        A cancelled call aborts the request (leaving AsyncEngine.generate does)."""
        async for out in self.engine.generate(prompt):
            yield out

    async def record_routing_stats(self) -> dict:
        cached = await self.engine.call(lambda engine: list(engine.block_manager.cached))
        return {"cached": cached, "in_flight": self.engine.num_in_flight, "at": time.time()}

    def check_health(self) -> None:
        if (health := self.engine.health())["status"] != "ok":
            raise RuntimeError(f"the engine is {health['status']}")

    def __del__(self) -> None:
        if hasattr(self, "engine"):
            self.engine.shutdown()
