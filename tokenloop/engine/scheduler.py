"""Scheduler: picks which sequences run in the next step and how many of their tokens, within a token budget.

Running sequences are served first (a decode needs one token; a chunked prefill continues), then waiting
ones join first-come first-served while the budget, `max_num_seqs` and free KV blocks allow.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tokenloop.engine.block_manager import BlockManager
from tokenloop.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # per sequence: tokens computed this step, from seq.num_computed_tokens on

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch([], [])
        budget = self.max_num_batched_tokens
        for seq in self.running:
            if budget == 0:
                break
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.block_manager.allocate(seq, seq.num_computed_tokens + n):
                raise RuntimeError(
                    f"the KV cache ran out of blocks for request {seq.request_id!r}; give the engine more KV cache memory"
                )
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table:
                self.block_manager.match_prefix(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.block_manager.allocate(seq, seq.num_computed_tokens + n):
                break  # retried next step, once running sequences have freed blocks
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        return batch

    def finish(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
