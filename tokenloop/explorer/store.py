"""The trees the explorer holds, bounded: at most max_trees (the least recently used goes first), none unused for
longer than ttl_s, at most max_branches each, their traced steps within max_trace_bytes and their KV blocks within
max_kv_fraction of the pool (least recently used trees are let go first). Letting a tree go releases its engine
requests: their blocks return to the pool."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from tokenloop.engine.block_manager import NULL_BLOCK
from tokenloop.engine.llm_engine import LLMEngine
from tokenloop.explorer.session import Explorer, RequestError
from tokenloop.explorer.tree import ExploreTree

SWEEP_S = 30.0


@dataclass(frozen=True, slots=True)
class StoreLimits:
    max_trees: int = 8
    ttl_s: float = 900.0
    max_branches: int = 64
    max_trace_bytes: int = 512 * 2**20
    max_kv_fraction: float = 0.5

    def __post_init__(self) -> None:
        if self.max_trees < 1 or self.max_branches < 1 or self.ttl_s <= 0 or self.max_trace_bytes < 1:
            raise ValueError(f"explorer limits must be positive, got {self}")
        if not 0 < self.max_kv_fraction <= 1:
            raise ValueError(f"max_kv_fraction must be in (0, 1], got {self.max_kv_fraction}")


class ExplorerStore:
    def __init__(
        self, explorer: Explorer, limits: StoreLimits = StoreLimits(), clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.explorer, self.limits, self.clock = explorer, limits, clock
        self.trees: OrderedDict[str, ExploreTree] = OrderedDict()  # least recently used first
        self.locks: dict[str, asyncio.Lock] = {}
        self._ids = 0
        self._sweeper: asyncio.Task | None = None

    def new_id(self) -> str:
        self._ids += 1
        return f"t{self._ids}"

    def get(self, tree_id: str) -> ExploreTree:
        tree = self.trees.get(tree_id)
        if tree is None:
            raise LookupError(
                f"tree {tree_id} does not exist (deleted, or let go after {self.limits.ttl_s:g} s unused)"
            )
        tree.last_used = self.clock()
        self.trees.move_to_end(tree_id)
        return tree

    def lock(self, tree_id: str) -> asyncio.Lock:
        return self.locks.setdefault(tree_id, asyncio.Lock())

    async def add(self, tree: ExploreTree) -> None:
        while len(self.trees) >= self.limits.max_trees:
            await self.delete(next(iter(self.trees)))
        tree.last_used = self.clock()
        self.trees[tree.id] = tree

    async def delete(self, tree_id: str) -> tuple[int, int]:
        """Let a tree go: (blocks freed, free blocks now)."""
        tree = self.trees.pop(tree_id, None)
        self.locks.pop(tree_id, None)
        if tree is None:
            raise LookupError(f"tree {tree_id} does not exist")
        return await self.explorer.release([b.request_id for b in tree.resident()])

    async def sweep(self) -> None:
        """Let go of the trees unused for longer than the time to live (each API call sweeps, and a task while
        trees are held)."""
        self._start_sweeper()
        await self.sweep_expired()

    async def make_room(self, tree: ExploreTree, new_branches: int = 1) -> None:
        """Before `tree` grows: a 400 if it is at its own caps; else the least recently used other trees are let
        go while the trees' traced steps or KV blocks are over theirs."""
        limits = self.limits
        if len(tree.branches) + new_branches > limits.max_branches:
            raise RequestError(f"tree {tree.id} has {len(tree.branches)} branches, the cap is {limits.max_branches}")
        if tree.trace_bytes() >= limits.max_trace_bytes:
            raise RequestError(
                f"tree {tree.id} holds {tree.trace_bytes() / 2**20:.0f} MiB of traced steps, the cap is "
                f"{limits.max_trace_bytes / 2**20:.0f} MiB: delete branches"
            )
        others = [t for t in self.trees.values() if t is not tree]
        while others and (
            sum(t.trace_bytes() for t in self.trees.values()) >= limits.max_trace_bytes
            or await self.blocks_held() > limits.max_kv_fraction * await self.num_blocks()
        ):
            await self.delete(others.pop(0).id)

    async def blocks_held(self) -> int:
        request_ids = [b.request_id for t in self.trees.values() for b in t.resident()]

        def held(engine: LLMEngine) -> int:
            tables = (table for r in request_ids for table in engine.retained(r).block_tables)
            return len({block for table in tables for block in table} - {NULL_BLOCK})

        return await self.explorer.engine.call(held)

    async def num_blocks(self) -> int:
        return await self.explorer.engine.call(lambda engine: engine.block_manager.num_blocks)

    def _start_sweeper(self) -> None:
        """A task that sweeps while trees are held, so that a tree nobody comes back to still lets its blocks go."""
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def _sweep_forever(self) -> None:
        while self.trees:
            await asyncio.sleep(min(SWEEP_S, self.limits.ttl_s))
            with contextlib.suppress(Exception):  # a failed sweep is retried at the next tick
                await self.sweep_expired()

    async def sweep_expired(self) -> None:
        now = self.clock()
        for tree_id in [t.id for t in self.trees.values() if now - t.last_used > self.limits.ttl_s]:
            if not self.lock(tree_id).locked():
                await self.delete(tree_id)
