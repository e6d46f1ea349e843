"""Scheduler on a handful of blocks: token budget, FCFS admission, chunked prefill, preemption of the newest."""

from __future__ import annotations

from tokenloop.engine.block_manager import BlockManager
from tokenloop.engine.scheduler import Scheduler
from tokenloop.engine.sequence import Sequence, SequenceStatus
from tokenloop.sampling.params import SamplingParams


def seq(name: str, n: int) -> Sequence:
    return Sequence(name, list(range(100, 100 + n)), n, SamplingParams())


def complete(batch) -> None:
    """What the engine does after a step: tokens computed, and a sampled token for sequences that caught up."""
    for s, n in zip(batch.seqs, batch.num_new_tokens):
        s.num_computed_tokens += n
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(7)


def test_prompts_are_chunked_to_the_token_budget_first_come_first_served():
    sched = Scheduler(BlockManager(16, 4, enable_prefix_caching=False), max_num_seqs=8, max_num_batched_tokens=8)
    a, b = seq("a", 6), seq("b", 5)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert [(s.seq_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)] == [("a", 6), ("b", 2)]
    complete(batch)
    batch = sched.schedule()  # a decodes one token, b continues its prefill
    assert [(s.seq_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)] == [("a", 1), ("b", 3)]


def test_max_num_seqs_keeps_the_rest_waiting():
    sched = Scheduler(BlockManager(16, 4), max_num_seqs=1, max_num_batched_tokens=64)
    a, b = seq("a", 3), seq("b", 3)
    sched.add(a)
    sched.add(b)
    assert sched.schedule().seqs == [a] and list(sched.waiting) == [b]


def test_the_newest_running_sequence_is_preempted_when_blocks_run_out():
    manager = BlockManager(3, 4, enable_prefix_caching=False)
    sched = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = seq("a", 4), seq("b", 4)
    sched.add(a)
    sched.add(b)
    complete(sched.schedule())  # both prompts fill one block each; each needs a second block to decode
    assert a.block_table == [0] and b.block_table == [1]
    batch = sched.schedule()  # a takes the last block; b cannot grow and is preempted
    assert batch.seqs == [a] and a.block_table == [0, 2]
    assert sched.num_preemptions == 1 and b.status is SequenceStatus.WAITING and list(sched.waiting) == [b]
    assert b.block_table == [] and b.num_computed_tokens == 0 and b.token_ids[-1] == 7  # its token is kept
    sched.finish(a)
    batch = sched.schedule()  # b is recomputed: prompt plus its generated token
    assert batch.seqs == [b] and batch.num_new_tokens == [5]
    sched.finish(b)
    assert manager.num_free_blocks == 3 and all(blk.ref_count == 0 for blk in manager.blocks)


def test_idle_sequences_holding_the_blocks_a_waiting_one_needs_give_them_back():
    """Beams waiting for their siblings' rows compute nothing; when they hold every block and the sibling waits
    for blocks, nothing would ever run again. They are preempted (to the back of the queue) instead."""
    sched = Scheduler(BlockManager(4, 4, enable_prefix_caching=False), max_num_seqs=8, max_num_batched_tokens=64)
    a, b, c = seq("a", 8), seq("b", 8), seq("c", 5)
    for s in (a, b):
        sched.add(s)
    batch = sched.schedule()
    for s, n in zip(batch.seqs, batch.num_new_tokens):
        s.num_computed_tokens += n  # computed, no token appended: idle, like a beam holding its row
    sched.add(c)
    batch = sched.schedule()
    # c first, then the idle ones behind it as blocks allow (b fits in what is left; a waits)
    assert [s.seq_id for s in batch.seqs] == ["c", "b"] and [s.seq_id for s in sched.waiting] == ["a"]
    assert a.num_computed_tokens == b.num_computed_tokens == 0 and sched.num_preemptions == 2
