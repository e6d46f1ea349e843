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


def test_requests_of_one_prompt_arriving_together_wait_a_step_and_take_its_blocks_from_the_cache():
    """b and c have a's prompt: the first step computes it once, for a; they wait (in their order, holding nothing)
    while d, another prompt, joins; the next step they take a's two full blocks from the cache and compute only
    the rest. Without the prefix cache nothing waits."""
    manager = BlockManager(16, 4)
    sched = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=64)
    a, b, c = seq("a", 10), seq("b", 10), seq("c", 10)
    d = Sequence("d", list(range(200, 210)), 10, SamplingParams())
    for s in (a, b, d, c):
        sched.add(s)
    batch = sched.schedule()
    assert [(s.seq_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)] == [("a", 10), ("d", 10)]
    assert list(sched.waiting) == [b, c] and b.block_table == [] and c.num_computed_tokens == 0
    complete(batch)
    for s in batch.seqs:
        manager.cache_full_blocks(s)
    batch = sched.schedule()
    assert [(s.seq_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)] == [("a", 1), ("d", 1), ("b", 2), ("c", 2)]
    assert b.block_table[:2] == c.block_table[:2] == a.block_table[:2]
    # Each prompt's lookup counts once, as it is scheduled: 4 x 10 tokens looked up, b's and c's 8 found.
    assert (manager.prefix_queried_tokens, manager.prefix_hit_tokens) == (40, 16)

    sched = Scheduler(BlockManager(16, 4, enable_prefix_caching=False), max_num_seqs=8, max_num_batched_tokens=64)
    a, b = seq("a", 10), seq("b", 10)
    sched.add(a)
    sched.add(b)
    assert sched.schedule().seqs == [a, b]


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


def test_update_from_output_rolls_a_rejected_draft_back_and_frees_the_blocks_it_held():
    from tokenloop.spec_decode.proposer import Draft

    manager = BlockManager(8, 16, enable_prefix_caching=False)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64)
    s = seq("a", 14)
    scheduler.add(s)
    batch = scheduler.schedule()
    s.token_ids.append(7)  # the output processor appends before the scheduler's update
    scheduler.update_from_output(batch, [1])
    assert s.num_computed_tokens == 14 and len(s.block_table) == 1
    batch = scheduler.schedule()
    s.draft = Draft([1, 2, 3, 4, 5, 6])  # what the speculator adds: six draft tokens and their blocks
    batch.num_new_tokens[0] += 6
    assert manager.allocate(s, s.num_tokens + 6) and len(s.block_table) == 2
    s.token_ids.append(8)  # every draft token rejected: one token from the verifying row
    scheduler.update_from_output(batch, [1])
    assert (s.num_computed_tokens, s.num_tokens, len(s.block_table), s.draft) == (15, 16, 1, None)
    assert manager.num_used_blocks == 1


def test_update_from_output_frees_finished_sequences_unless_they_keep_their_blocks_and_skips_failed_ones():
    manager = BlockManager(8, 16, enable_prefix_caching=False)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64)
    done, kept, failed = seq("a", 5), seq("b", 5), seq("c", 5)
    kept.keep_blocks = True
    ended = []
    scheduler.on_finish.append(ended.append)
    for s in (done, kept, failed):
        scheduler.add(s)
    batch = scheduler.schedule()
    for s in (done, kept):
        s.token_ids.append(7)
        s.finish_reason = "length"
    scheduler.update_from_output(batch, [1, 1, None])
    assert ended == [done, kept] and scheduler.running == [failed]
    assert (done.block_table, len(kept.block_table), failed.num_computed_tokens) == ([], 1, 0)
    scheduler.release_kept(kept)
    assert manager.num_used_blocks == 1 and not kept.keep_blocks  # only the failed one's, until the engine drops it
