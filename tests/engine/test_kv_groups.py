"""KV cache groups (vLLM's hybrid KV cache manager): how a model's layers are grouped, and the block manager with
a full-attention group beside a sliding-window one, on a handful of blocks with exact block ids: the sliding group
gives back the blocks before its window (one block kept for a fork), a prefix hit takes only the window's blocks
there, a fork further back than the kept blocks shares nothing, and a long sequence fits a pool that could not
hold it in every group."""

from __future__ import annotations

import dataclasses

from tokenloop.engine.block_manager import NULL_BLOCK, BlockManager
from tokenloop.engine.kv_groups import KVCacheGroup, kv_cache_groups, kv_cache_tokens
from tokenloop.engine.sequence import Sequence
from tokenloop.models.loader import load_config
from tokenloop.sampling.params import SamplingParams

X = NULL_BLOCK


def seq(tokens: list[int], name: str = "s") -> Sequence:
    return Sequence(name, list(tokens), len(tokens), SamplingParams())


def step(manager: BlockManager, s: Sequence, n: int) -> None:
    """What the scheduler does for `n` new tokens of `s`: allocate, compute, then the post-step update."""
    assert manager.allocate(s, s.num_computed_tokens + n)
    s.num_computed_tokens += n
    manager.cache_full_blocks(s)


def decode(manager: BlockManager, s: Sequence, count: int) -> None:
    for _ in range(count):
        s.token_ids.append(1000 + s.num_tokens)
        step(manager, s, 1)


def test_gemma_layers_group_full_with_full_and_sliding_with_sliding_in_groups_of_one_size(tiny_gemma3_folder):
    config = load_config(tiny_gemma3_folder)  # 6 layers: 5 sliding (window 8), then one full
    assert kv_cache_groups(config) == [KVCacheGroup((5,), None)] + [KVCacheGroup((i,), 8) for i in range(5)]
    # Gemma 3 270M's pattern: 18 layers, every sixth full: groups of the 3 full layers and 5 of 3 sliding ones.
    kinds = tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18))
    gemma = dataclasses.replace(config, num_layers=18, layer_types=kinds)
    assert [g.layers for g in kv_cache_groups(gemma)] == [
        (5, 11, 17), (0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13), (14, 15, 16)
    ]  # fmt: skip
    # One kind of layer: one group of them all.
    assert kv_cache_groups(dataclasses.replace(config, layer_types=None, sliding_window=None)) == [
        KVCacheGroup(tuple(range(6)), None)
    ]


def test_the_sliding_group_gives_back_the_blocks_before_its_window_and_one_more():
    m = BlockManager(16, 4, windows=(None, 4))
    s = seq(range(10))
    step(m, s, 10)
    assert s.block_tables == [[0, 1, 2], [3, 4, 5]] and m.num_released_blocks == 0
    decode(m, s, 1)  # computed 11: the next query (11) reads 8..11; block 1 (4..7) is kept for a fork
    assert s.block_tables == [[0, 1, 2], [X, 4, 5]] and m.num_released_blocks == 1
    decode(m, s, 8)  # computed 19
    assert s.block_tables == [[0, 1, 2, 6, 8], [X, X, X, 7, 9]] and m.num_released_blocks == 3
    # Given back while cached: they stay in the prefix cache, first in line to be evicted.
    assert list(m.free_queue)[-3:] == [3, 4, 5]


def test_a_prefix_hit_takes_every_full_block_but_only_the_window_of_the_sliding_group():
    m = BlockManager(16, 4, windows=(None, 4))
    s = seq(range(10))
    step(m, s, 10)
    decode(m, s, 10)  # 20 tokens, all computed: 5 full blocks in each group, the sliding one's first 3 given back
    m.free(s)
    t = seq(s.token_ids + [7])
    m.match_prefix(t)  # the query at 20 reads 17..20: the sliding group takes block 4 only
    assert t.block_tables == [[0, 1, 2, 6, 8], [X, X, X, X, 9]] and t.num_computed_tokens == 20
    # Once the sliding group's block of the window is evicted, the hit falls back to where the window is whole.
    u = seq(s.token_ids[:12] + [7])
    v = BlockManager(16, 4, windows=(None, 4))
    step(v, w := seq(s.token_ids[:12]), 12)
    hashes = list(w.block_hashes)
    v.free(w)
    v.cached_by_group[1].pop(hashes[2])  # the sliding group's block 2 is gone
    v.match_prefix(u)  # 3 blocks: the query at 12 reads 9..11 (block 2); 2 blocks: the query at 8 reads 5..7
    assert u.num_computed_tokens == 8 and u.block_tables == [[0, 1], [X, 4]]


def test_a_fork_behind_the_blocks_the_sliding_group_kept_shares_nothing():
    m = BlockManager(16, 4, windows=(None, 4))
    parent = seq(range(10))
    step(m, parent, 10)
    decode(m, parent, 10)  # computed 20: the sliding group keeps blocks 3 and 4 (positions 12..19)
    near, far = seq(parent.token_ids[:20], "near"), seq(parent.token_ids[:20], "far")
    assert m.fork(parent, near, 19) == 19 and near.block_tables == [[0, 1, 2, 6, 8], [X, X, X, 7, 9]]
    assert m.fork(parent, far, 10) == 0 and far.block_tables == []  # its window (7..10) was given back


def test_a_long_sequence_fits_a_pool_that_could_not_hold_it_in_every_group():
    """The full group's 10 blocks and the sliding group's last 2: 40 tokens in 12 of 14 blocks, not 20."""
    m = BlockManager(14, 4, windows=(None, 4))
    s = seq(range(4))
    step(m, s, 4)
    decode(m, s, 35)
    assert s.num_computed_tokens == 39 and len(s.block_tables[0]) == 10 and m.num_free_blocks == 2
    assert s.block_tables[1][:8] == [X] * 8 and m.num_released_blocks == 8


def test_kv_cache_tokens_counts_the_full_groups_blocks_once_the_sliding_ones_hold_their_window(tiny_gemma3_folder):
    config = load_config(tiny_gemma3_folder)  # one full group, 5 sliding ones of window 8
    # A step of 16 tokens at most: a sliding group holds (8 + 16 + 15) // 16 + 3 = 5 blocks at most.
    assert kv_cache_tokens(config, 60, 16, 16) == (60 - 5 * 5) * 16
    assert kv_cache_tokens(config, 24, 16, 16) == 4 * 16  # below that every group holds every block
    one_kind = dataclasses.replace(config, layer_types=None, sliding_window=None)
    assert kv_cache_tokens(one_kind, 60, 16, 16) == 60 * 16  # one group of all 6 layers
