"""KV block manager on a handful of blocks: exact block ids, reference counts, prefix hits, eviction order."""

from __future__ import annotations

from tokenloop.engine.block_manager import BlockManager
from tokenloop.engine.sequence import Sequence
from tokenloop.sampling.params import SamplingParams


def seq(tokens: list[int], name: str = "s") -> Sequence:
    return Sequence(name, list(tokens), len(tokens), SamplingParams())


def run_prefill(manager: BlockManager, s: Sequence) -> None:
    """What the scheduler and engine do for a prompt: prefix match, allocate, compute, cache full blocks."""
    manager.match_prefix(s)
    assert manager.allocate(s, s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    manager.cache_full_blocks(s)


def test_allocation_takes_free_blocks_in_order_and_reuses_uncached_blocks_first():
    m = BlockManager(num_blocks=6, block_size=4)
    a = seq(range(10))
    assert m.allocate(a, 10) and a.block_table == [0, 1, 2]
    assert [b.ref_count for b in m.blocks] == [1, 1, 1, 0, 0, 0]
    m.free(a)
    assert list(m.free_queue) == [0, 1, 2, 3, 4, 5]  # nothing cached: the same pages are handed out again
    assert all(b.ref_count == 0 for b in m.blocks)


def test_freed_cached_blocks_go_last_tail_first_and_uncached_ones_first():
    m = BlockManager(num_blocks=6, block_size=4)
    a = seq(range(10))
    run_prefill(m, a)  # blocks 0 and 1 full and cached, block 2 holds the last 2 tokens
    m.free(a)
    assert list(m.free_queue) == [2, 3, 4, 5, 1, 0]


def test_allocation_fails_whole_when_blocks_run_out():
    m = BlockManager(num_blocks=2, block_size=4)
    a = seq(range(12))
    assert not m.allocate(a, 12)
    assert a.block_table == [] and m.num_free_blocks == 2


def test_a_repeated_prefix_hits_the_cache_and_shares_blocks():
    m = BlockManager(num_blocks=8, block_size=4)
    a = seq(range(10), "a")
    run_prefill(m, a)
    b = seq(list(range(8)) + [50, 51, 52], "b")
    m.match_prefix(b)
    assert b.block_table == [0, 1] and b.num_computed_tokens == 8 == b.num_cached_tokens
    assert [m.blocks[i].ref_count for i in (0, 1, 2)] == [2, 2, 1]


def test_the_last_prompt_token_is_always_recomputed():
    m = BlockManager(num_blocks=8, block_size=4)
    run_prefill(m, seq(range(8), "a"))
    b = seq(range(8), "b")
    m.match_prefix(b)
    assert b.block_table == [0] and b.num_computed_tokens == 4


def test_a_hit_needs_the_whole_chain_not_just_the_block():
    m = BlockManager(num_blocks=8, block_size=4)
    run_prefill(m, seq(list(range(8)) + [99], "a"))
    b = seq([7, 7, 7, 7] + list(range(4, 8)) + [99], "b")  # same second block, different parent
    m.match_prefix(b)
    assert b.block_table == []


def test_cached_blocks_of_finished_requests_survive_until_evicted_tail_first():
    m = BlockManager(num_blocks=4, block_size=4)
    a = seq(list(range(12)) + [99], "a")
    run_prefill(m, a)
    m.free(a)
    assert list(m.free_queue) == [3, 2, 1, 0]  # tail of the chain first in line for eviction
    c = seq(range(100, 104), "c")
    assert m.allocate(c, 4) and c.block_table == [3]
    d = seq(range(200, 204), "d")
    assert m.allocate(d, 4) and d.block_table == [2]  # evicts the chain's last full block
    again = seq(list(range(12)) + [99], "again")
    m.match_prefix(again)
    assert again.block_table == [0, 1]  # the head of the chain is still cached


def test_prefix_caching_off_never_hits():
    m = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    run_prefill(m, seq(range(10), "a"))
    b = seq(range(10), "b")
    m.match_prefix(b)
    assert b.block_table == [] and not m.cached


def test_a_fork_shares_every_block_and_the_first_writer_into_the_shared_tail_copies_it():
    m = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    parent = seq(range(10), "p")
    run_prefill(m, parent)  # blocks 0, 1 full; block 2 holds tokens 8, 9
    child = seq(range(10), "c")
    m.fork(parent, child, 10)
    child.num_computed_tokens = 10
    assert child.block_table == [0, 1, 2] and [b.ref_count for b in m.blocks[:4]] == [2, 2, 2, 0]
    parent.token_ids.append(10)
    assert m.blocks_needed(parent, 11) == 1  # its next token goes into block 2, which the child holds too
    assert m.allocate(parent, 11) and parent.block_table == [0, 1, 3]
    assert m.take_copies() == [(2, 3)] and m.take_copies() == []
    assert [b.ref_count for b in m.blocks[:4]] == [2, 2, 1, 1]
    child.token_ids.append(11)
    assert (
        m.blocks_needed(child, 11) == 0 and m.allocate(child, 11) and child.block_table == [0, 1, 2]
    )  # block 2 is its own now
    assert m.take_copies() == []
    m.free(parent)
    assert [b.ref_count for b in m.blocks[:4]] == [1, 1, 1, 0] and list(m.free_queue)[0] == 3
    m.free(child)
    assert all(b.ref_count == 0 for b in m.blocks) and m.num_free_blocks == 8


def test_a_fork_that_recomputes_the_last_prompt_token_copies_the_full_cached_block_it_writes_into():
    m = BlockManager(num_blocks=8, block_size=4)
    parent = seq(range(8), "p")
    run_prefill(m, parent)  # two full blocks, both cached
    child = seq(range(8), "c")
    m.fork(parent, child, 7)
    child.num_computed_tokens = 7  # n > 1: position 7 again, to sample its own first token
    assert len(child.block_hashes) == 1 and m.allocate(child, 8) and child.block_table == [0, 2]
    assert m.take_copies() == [(1, 2)] and len(child.block_hashes) == 1
    child.num_computed_tokens = 8
    m.cache_full_blocks(child)  # the same tokens: the cache keeps the parent's block
    assert m.cached[m.blocks[1].hash] == 1 and m.blocks[2].hash == m.blocks[1].hash
    m.free(child)
    m.free(parent)
    assert all(b.ref_count == 0 for b in m.blocks)


def test_a_fork_inside_a_full_cached_block_copies_it_even_once_the_parent_let_it_go():
    m = BlockManager(num_blocks=6, block_size=4)
    parent = seq(range(10), "p")
    run_prefill(m, parent)  # blocks 0, 1 full and cached; block 2 holds tokens 8, 9
    child = seq([0, 1, 2, 3, 4, 5, 99], "c")  # the parent's first 6 tokens, then its own: a fork at position 6
    m.fork(parent, child, 6)
    child.num_computed_tokens = 6
    assert child.block_table == [0, 1] and len(child.block_hashes) == 1
    m.free(parent)  # block 1 is the child's alone now, but the cache still lists it under tokens 4..7
    assert m.blocks_needed(child, 7) == 1 and m.allocate(child, 7) and child.block_table == [0, 2]
    assert m.take_copies() == [(1, 2)] and m.blocks[1].ref_count == 0 and 1 in m.free_queue
    other = seq(range(9), "o")
    m.match_prefix(other)  # the parent's prefix is still served from its untouched blocks
    assert other.block_table == [0, 1] and other.num_cached_tokens == 8


def test_copy_on_write_counts_in_the_blocks_needed_and_fails_whole():
    m = BlockManager(num_blocks=3, block_size=4, enable_prefix_caching=False)
    parent = seq(range(6), "p")
    run_prefill(m, parent)  # blocks 0, 1
    child = seq(range(6), "c")
    m.fork(parent, child, 6)
    child.num_computed_tokens = 6
    child.token_ids += [6, 7, 8]
    assert m.blocks_needed(child, 9) == 2 and not m.allocate(child, 9)  # a copy of block 1 and block 3: one is free
    assert child.block_table == [0, 1] and m.take_copies() == [] and m.blocks[1].ref_count == 2
