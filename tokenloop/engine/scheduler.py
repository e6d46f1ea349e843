"""Scheduler: picks which sequences run in the next step and how many of their tokens, within a token budget.

Running sequences are served first (a decode needs one token; a chunked prefill continues), then waiting
ones join first-come first-served while the budget, `max_num_seqs` and free KV blocks allow. A waiting sequence
whose next block another sequence of the step computes (requests of one prompt arriving together) waits a step,
keeping its place, and then takes that block and the others computed with it from the prefix cache, instead of
computing them again beside it (SGLang's in-batch prefix caching). When blocks run out, the newest running
sequence is preempted: its blocks are freed and it is recomputed later, its generated tokens kept (the prefix
cache often gives most of them back).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenloop.engine.block_manager import BlockManager
from tokenloop.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # per sequence: tokens computed this step, from seq.num_computed_tokens on
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (source, destination) blocks to copy first

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Out of the batches, blocks kept, until resumed (their reader fell behind); never preempted.
        self.paused: list[Sequence] = []
        self.num_preemptions = 0
        self.on_finish: list[Callable[[Sequence], None]] = []  # told of every sequence that ends (a proposer's state)
        # Told of every fork (parent, child, the child's computed tokens): a proposer may start it from the parent.
        self.on_fork: list[Callable[[Sequence, Sequence, int], None]] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch([], [])
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n == 0:  # nothing new: a beam waiting for the other beams of its request
                i += 1
                continue
            while not self.block_manager.allocate(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]  # the newest; never one already scheduled this step (those come first)
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                batch.seqs.append(seq)
                batch.num_new_tokens.append(n)
                budget -= n
                i += 1
        # The chain hashes of the full blocks the step's sequences write: only a waiting sequence asks.
        computing = (
            {h for seq, n in zip(batch.seqs, batch.num_new_tokens) for h in self.block_manager.blocks_written(seq, n)}
            if self.waiting
            else set()
        )
        deferred = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting.popleft()
            if not seq.block_tables:
                self.block_manager.match_prefix(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            written = self.block_manager.blocks_written(seq, n)
            if written and written[0] in computing and not seq.score_prompt:
                self._release(seq)  # next step its prefix is cached further on
                deferred.append(seq)
                continue
            if not self.block_manager.allocate(seq, seq.num_computed_tokens + n):
                # Wait holding nothing: cached blocks kept by a waiting request could starve the running ones.
                self._release(seq)
                self.waiting.appendleft(seq)
                break  # retried next step, once running sequences have freed blocks
            self.block_manager.count_prefix_lookup(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            computing.update(written)
            budget -= n
        self.waiting.extendleft(reversed(deferred))
        if not batch and self.waiting:
            # Nothing runs: every running sequence is idle (a beam waiting for its siblings' rows) and holds the
            # blocks the waiting ones need, so nothing would ever change. They give them back, newest first, and
            # wait behind the others (their rows are kept; they are recomputed later).
            idle = [seq for seq in self.running if seq.num_tokens == seq.num_computed_tokens]
            for seq in reversed(idle):
                self.preempt(seq, front=False)
            if idle:
                return self.schedule()
        batch.block_copies = self.block_manager.take_copies()
        return batch

    def update_from_output(self, batch: ScheduledBatch, num_sampled: list[int | None]) -> None:
        """After a step: each sequence's computed tokens step on (a verified draft's rejected tokens are rolled
        back: their K/V slots abandoned, the blocks past its tokens freed), its full blocks are registered in the
        prefix cache (so that only computed, accepted tokens ever reach it), and a sequence that finished leaves,
        its blocks freed unless it keeps them for forks.

        num_sampled[i]: the tokens batch.seqs[i] sampled (a verified draft's accepted ones and one more; 0 for a
        prefill chunk), or None when its request failed: nothing of that step counts (its K/V may be wrong)."""
        for seq, n, got in zip(batch.seqs, batch.num_new_tokens, num_sampled):
            draft, seq.draft = seq.draft, None
            if got is None:
                continue
            if draft is not None:
                rejected = len(draft) + 1 - got
                seq.num_computed_tokens = min(seq.num_computed_tokens + n - rejected, seq.num_tokens - 1)
                self.block_manager.trim(seq)
            else:
                seq.num_computed_tokens += n
            self.block_manager.cache_full_blocks(seq)
            if seq.finish_reason is not None:
                self.finish(seq, free=not seq.keep_blocks)

    def fork(self, parent: Sequence, child: Sequence, num_computed_tokens: int) -> None:
        """Start `child`, whose first `num_computed_tokens` tokens are its parent's, on its parent's blocks: it runs
        at once, from there on, and shares those blocks until one of them writes into a shared one (or computes
        them again, where a sliding group has given back blocks its window needs)."""
        child.num_computed_tokens = self.block_manager.fork(parent, child, num_computed_tokens)
        for listener in self.on_fork:
            listener(parent, child, child.num_computed_tokens)
        if len(self.running) < self.max_num_seqs:
            child.status = SequenceStatus.RUNNING
            self.running.append(child)
        else:  # the batch is full: it waits like any request (and may give its blocks back while it does)
            self.waiting.append(child)

    def preempt(self, seq: Sequence, front: bool = True) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        self.num_preemptions += 1
        if front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def _release(self, seq: Sequence) -> None:
        """Give back a sequence's blocks; its K/V is then computed again (the prefix cache may return some)."""
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0

    def pause(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        else:
            return
        self.paused.append(seq)

    def resume(self, seq: Sequence) -> None:
        if seq not in self.paused:
            return
        self.paused.remove(seq)
        if seq.status is SequenceStatus.RUNNING and len(self.running) < self.max_num_seqs:
            self.running.append(seq)
            return
        if seq.status is SequenceStatus.RUNNING:  # the batch filled up meanwhile: wait, holding nothing
            self._release(seq)
            seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, free: bool = True) -> None:
        """Out of the queues; its blocks freed, unless `free` is False (kept for forks: release_kept frees them)."""
        seq.status = SequenceStatus.FINISHED
        for queue in (self.running, self.waiting, self.paused):
            if seq in queue:
                queue.remove(seq)
                break
        if free:
            self.block_manager.free(seq)
        for listener in self.on_finish:
            listener(seq)

    def release_kept(self, seq: Sequence) -> None:
        """Free the blocks a finished sequence kept for forks."""
        seq.keep_blocks = False
        self.block_manager.free(seq)
