"""The explorer's store keeps what trees hold bounded: a cap on trees (least recently used let go first), a time to
live, a cap on branches and traced bytes per tree, and a share of the KV pool; letting a tree go releases its engine
requests. A fake engine stands for the block manager here; tests/explorer/test_api.py frees real blocks."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from tokenloop.engine.trace import TraceStep
from tokenloop.explorer.session import RequestError
from tokenloop.explorer.store import ExplorerStore, StoreLimits
from tokenloop.explorer.tree import ExploreTree


class FakeEngine:
    def __init__(self, num_blocks: int) -> None:
        self.block_manager = SimpleNamespace(num_blocks=num_blocks)
        self.tables: dict[str, list[int]] = {}
        self.released: list[str] = []

    def retained(self, request_id: str):
        return SimpleNamespace(block_tables=[self.tables[request_id]])

    async def call(self, fn):
        return fn(self)

    async def release(self, request_ids: list[str]) -> tuple[int, int]:
        self.released += request_ids
        return len(request_ids), 0


def tree(store: ExplorerStore, engine: FakeEngine, blocks: list[int] = (), trace_bytes: int = 0) -> ExploreTree:
    t = ExploreTree(store.new_id(), [1, 2, 3], {}, 0, 5, 4)
    b = t.new_branch(None, 3, "sample")
    b.request_id = f"{t.id}-r"
    engine.tables[b.request_id] = list(blocks)
    if trace_bytes:
        b.steps.append(TraceStep(torch.zeros(trace_bytes // 4), None))
    return t


def make(**limits) -> tuple[ExplorerStore, FakeEngine, list[float]]:
    engine, now = FakeEngine(num_blocks=10), [0.0]
    explorer = SimpleNamespace(engine=engine, release=engine.release)
    return ExplorerStore(explorer, StoreLimits(**limits), clock=lambda: now[0]), engine, now


def test_a_new_tree_beyond_the_cap_lets_the_least_recently_used_go_and_its_requests():
    async def run():
        store, engine, now = make(max_trees=2)
        first, second = tree(store, engine), tree(store, engine)
        await store.add(first)
        await store.add(second)
        now[0] = 1.0
        store.get(first.id)  # used again: the second is now the least recently used
        await store.add(tree(store, engine))
        assert list(store.trees) == [first.id, "t3"] and engine.released == [f"{second.id}-r"]
        with pytest.raises(LookupError):
            store.get(second.id)

    asyncio.run(run())


def test_trees_unused_past_the_time_to_live_are_let_go():
    async def run():
        store, engine, now = make(ttl_s=60)
        old, fresh = tree(store, engine), tree(store, engine)
        await store.add(old)
        now[0] = 50.0
        await store.add(fresh)
        now[0] = 61.0
        await store.sweep()
        assert list(store.trees) == [fresh.id] and engine.released == [f"{old.id}-r"]

    asyncio.run(run())


def test_a_tree_at_its_branch_or_trace_cap_is_refused_more():
    async def run():
        store, engine, _ = make(max_branches=1, max_trace_bytes=1024)
        t = tree(store, engine)
        await store.add(t)
        with pytest.raises(RequestError, match="the cap is 1"):
            await store.make_room(t)
        await store.make_room(t, new_branches=0)  # continuing a branch adds none
        big = tree(store, engine, trace_bytes=2048)
        await store.add(big)
        with pytest.raises(RequestError, match="MiB of traced steps"):
            await store.make_room(big, new_branches=0)

    asyncio.run(run())


def test_trees_over_their_share_of_the_kv_pool_let_the_least_recently_used_others_go():
    async def run():
        store, engine, _ = make(max_kv_fraction=0.5)
        a, b, c = tree(store, engine, [0, 1, 2]), tree(store, engine, [3, 4]), tree(store, engine, [0, 5])
        for t in (a, b, c):
            await store.add(t)
        assert await store.blocks_held() == 6  # block 0 counted once: a prefix both share
        await store.make_room(c)
        assert list(store.trees) == [b.id, c.id] and engine.released == [f"{a.id}-r"]  # 4 of 10 blocks now

    asyncio.run(run())
