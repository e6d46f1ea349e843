"""The proposer interface: something cheap guesses each sequence's next tokens; the target model verifies them.

The verifier (spec_decode/rejection_sampler.py) does not know which proposer ran: it sees draft tokens and, where the
proposer sampled them, the distribution q it sampled from (none: q is one-hot on the draft, as for n-gram lookup).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenloop.engine.scheduler import ScheduledBatch
from tokenloop.engine.sequence import Sequence
from tokenloop.spec_decode.cost_model import StepCosts


@dataclass(slots=True)
class Draft:
    token_ids: list[int]
    probs: torch.Tensor | None = None  # [len(token_ids), V] float32: the q each token was drawn from; None = one-hot

    def __len__(self) -> int:
        return len(self.token_ids)


class Proposer:
    """propose(seqs, num_tokens) -> one Draft per sequence, of at most num_tokens[i] tokens (maybe none)."""

    # What drafting costs per step (a draft model's forward passes), None when it costs next to nothing (lookup).
    costs: StepCosts | None = None
    # It drafts from the target's features: each step then returns every new token's final hidden state (observe).
    wants_hidden_states: bool = False

    def limits(self, seqs: list[Sequence], k: int) -> list[int]:
        """How many tokens it could propose for each sequence, at most k (a lookup knows before it proposes)."""
        return [k] * len(seqs)

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Draft]:
        raise NotImplementedError

    def fork(self, parent: Sequence, child: Sequence, num_computed_tokens: int) -> None:
        """`child` starts on `parent`'s first num_computed_tokens computed tokens (Scheduler.fork)."""

    def release(self, seq: Sequence) -> None:
        """The sequence has finished or been aborted: forget what is kept for it (a draft model's KV blocks)."""

    def observe(self, batch: ScheduledBatch, num_sampled: list[int | None], hidden: torch.Tensor) -> None:
        """After a verified step (before the scheduler steps the sequences on), with wants_hidden_states: hidden
        [T, d] holds each batch sequence's new tokens' final hidden states, batch.num_new_tokens[i] rows each from
        position seq.num_computed_tokens (a draft's rows included); num_sampled as Speculator.record has it."""
