"""The KV handoff: a decode worker copies a prompt's blocks out of a prefill worker's pools, in shared memory.

The prefill worker computed the prompt and keeps its blocks (retain=True) until told to let them go; it names
them by chain hash and block id. The decode worker, on its step thread just before it queues the request, skips
the blocks it holds already (equal hashes are equal K/V: engine/block_manager.py) and copies the others into
free blocks of its own, registered under those hashes; the request then finds them all in its prefix cache and
computes only its last, partial block, sampling its first token itself (so its seed, grammar, adapter and drafter
start from this engine's own state, and the tokens are those of colocated serving: a cache hit computes the same
K/V as a recompute, on any chunking). No KV byte goes through a pipe: each side maps the other's pool files.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from tokenloop.engine.block_manager import BlockManager
from tokenloop.engine.llm_engine import LLMEngine
from tokenloop.engine.shared_pools import map_pool, pool_paths


@dataclass(frozen=True, slots=True)
class KVHandoff:
    """What a decode worker needs to take a prompt's blocks from a prefill worker: the name of its pools and,
    for each full block of the prompt it holds, (KV cache group, index in the prompt, chain hash, block id in
    those pools)."""

    pools: str
    blocks: list[tuple[int, int, int, int]]


@dataclass(slots=True)
class HandoffStats:
    copied: int = 0  # blocks copied from the prefill worker
    skipped: int = 0  # blocks the decode worker held already
    bytes: int = 0
    seconds: float = 0.0


class PeerPools:
    """The pools of the prefill workers a decode worker has taken blocks from, mapped once per name."""

    def __init__(self) -> None:
        self._mapped: dict[str, list[torch.Tensor]] = {}

    def get(self, name: str, like: list[torch.Tensor]) -> list[torch.Tensor]:
        """The pools of engine `name`, shaped as this engine's own pools `like` ([kv_heads, slots, head_dim])."""
        pools = self._mapped.get(name)
        if pools is None:
            paths = pool_paths(name)
            if len(paths) != len(like):
                raise ValueError(f"prefill worker {name!r} has {len(paths)} KV pools, this engine {len(like)}")
            pools = [map_pool(p, own.dtype).view(own.shape[0], -1, own.shape[2]) for p, own in zip(paths, like)]
            self._mapped[name] = pools
        return pools

    def forget(self, name: str) -> None:
        """A prefill worker is gone (its files removed): its mappings go too."""
        self._mapped.pop(name, None)


def own_pools(engine: LLMEngine) -> list[torch.Tensor]:
    """The engine's KV pools in the order engine/shared_pools.py names them: each pool's K, then its V."""
    return [pool for pair in zip(engine.runner.k_pools, engine.runner.v_pools) for pool in pair]


def take_blocks(
    engine: LLMEngine, peers: PeerPools, handoff: KVHandoff, token_ids: list[int], extra: bytes = b""
) -> HandoffStats:
    """Make the handoff's blocks cached blocks of `engine` (on its step thread, before the request is added):
    those it holds are skipped, the others copied from the peer's pools, as many as it has free blocks for."""
    started = time.perf_counter()
    manager: BlockManager = engine.block_manager
    size = manager.block_size
    stats, wanted = HandoffStats(), []
    for group, i, block_hash, source in handoff.blocks:
        tokens = tuple(token_ids[i * size : (i + 1) * size])
        if manager.holds(group, block_hash, tokens, extra):
            stats.skipped += 1
        else:
            wanted.append((group, block_hash, tokens, source))
    # Each adoption takes the first free block; past the free blocks that are not this prompt's, it would evict
    # one of the blocks just taken or kept (the chain then breaks there: the request computes the rest itself).
    held_free = sum(
        1
        for g, _, h, _ in handoff.blocks
        if (b := manager.cached_by_group[g].get(h)) is not None and b in manager.free_queue
    )
    wanted = wanted[: max(manager.num_free_blocks - held_free, 0)]
    pairs = [(source, manager.adopt(*block, extra)) for *block, source in wanted]
    if pairs:
        mine = own_pools(engine)
        theirs = peers.get(handoff.pools, mine)
        for src, dst, n in _runs(pairs):  # slices, not an index: a block run is one strided copy per head
            for own, peer in zip(mine, theirs):  # [kv_heads, slots, head_dim]
                own[:, dst * size : (dst + n) * size] = peer[:, src * size : (src + n) * size]
        per_block = sum(own.shape[0] * own.shape[2] * own.element_size() for own in mine) * size
        stats.bytes = per_block * len(pairs)
    stats.copied = len(pairs)
    stats.seconds = time.perf_counter() - started
    return stats


def _runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(source, destination) block pairs as runs (first source, first destination, length) consecutive on both
    sides."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in pairs:
        if runs and (last := runs[-1])[0] + last[2] == src and last[1] + last[2] == dst:
            runs[-1] = (last[0], last[1], last[2] + 1)
        else:
            runs.append((src, dst, 1))
    return runs
