"""KV cache groups (vLLM's hybrid KV cache manager): layers that attend alike share a block table.

A model whose layers all attend to every position has one group of all its layers. A hybrid one (Gemma 3: five
sliding-window layers to each full-attention one) groups full layers with full layers and sliding layers with
sliding layers, every group the same size, so that a KV block, which holds one group's layers for `block_size`
positions, is one size whatever its group and all groups draw on one pool of blocks. Each sequence then holds a
block table per group; a sliding group gives back the blocks wholly before its window while the full groups keep
every block. Layer i of every group writes the same pools (pool i of the runner), at its own group's blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenloop.models import kv_layout
from tokenloop.models.config import ModelConfig


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    layers: tuple[int, ...]  # the model's layer indices; layer layers[i] uses pool i
    window: int | None  # the positions each query attends back to (itself included); None: all


def kv_cache_groups(config: ModelConfig) -> list[KVCacheGroup]:
    """The model's layers in groups of one attention kind, full attention first: each kind's layers in order, cut
    into groups of as many layers as the scarcest kind has (the last group of a kind may have fewer)."""
    kinds: dict[int | None, list[int]] = {}
    for layer in range(config.num_layers):
        kinds.setdefault(config.layer_window(layer), []).append(layer)
    size = min(len(layers) for layers in kinds.values())
    order = sorted(kinds, key=lambda window: (window is not None, window or 0))
    return [
        KVCacheGroup(tuple(kinds[window][i : i + size]), window)
        for window in order
        for i in range(0, len(kinds[window]), size)
    ]


def kv_cache_windows(config: ModelConfig) -> tuple[int | None, ...]:
    """Per KV cache group, its window: what the block manager needs of the groups."""
    return tuple(group.window for group in kv_cache_groups(config))


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """The bytes of one KV block: K and V of one group's layers (the largest group) for `block_size` positions."""
    layers = max(len(group.layers) for group in kv_cache_groups(config))
    return 2 * layers * block_size * config.num_kv_heads * kv_layout.bytes_per_token(config.head_dim, dtype)


def kv_cache_tokens(config: ModelConfig, num_blocks: int, block_size: int, max_chunk: int) -> int:
    """The tokens one sequence can always hold in `num_blocks` blocks, computed `max_chunk` tokens at a time at most:
    each group holds a block per `block_size` positions, a sliding group at most its window's and a chunk's (with
    the partial blocks at both ends and the block it keeps for a fork)."""
    groups = kv_cache_groups(config)
    caps = [(g.window + max_chunk + block_size - 1) // block_size + 3 if g.window else None for g in groups]

    def held(blocks_per_group: int) -> int:
        return sum(blocks_per_group if cap is None else min(blocks_per_group, cap) for cap in caps)

    if None not in caps and held(num_blocks) <= num_blocks:
        return 2**31 - 1  # every layer slides: no length outgrows the pool
    low, high = 0, num_blocks  # the most blocks per group that fit, by bisection (held grows with it)
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if held(mid) <= num_blocks else (low, mid - 1)
    return low * block_size
