"""Speculator: the engine's one entry to speculative decoding. Before a step it gives drafts to the scheduled
sequences that will sample (as many tokens as the cost model chooses); after it, it records what was accepted.

Where drafting is skipped: beams (they need every candidate of a row), a prompt being scored, and the tokens
past max_tokens or the context. With `adaptive` off, or for a seeded request, a sequence drafts the most it
may (num_speculative_tokens, or what the lookup finds), whatever the timings: the cost model's choice moves
with the machine's speed, and a seeded request's tokens must not.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from tokenloop.engine.block_manager import BlockManager
from tokenloop.engine.scheduler import ScheduledBatch
from tokenloop.engine.sequence import Sequence
from tokenloop.spec_decode.config import SpeculativeConfig
from tokenloop.spec_decode.cost_model import StepCosts, choose_draft_lengths
from tokenloop.spec_decode.proposer import Draft, Proposer

PRIOR_WEIGHT = 1.0  # a request's acceptance rate starts from the proposer's mean as if seen over this many drafts
INITIAL_ACCEPTANCE = 0.5  # the proposer's mean before any draft was verified
logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SpecStats:
    """Totals since the start (the Prometheus counters read them)."""

    num_drafts: int = 0  # verified drafts (sequence-steps with one)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [k]: drafts whose token at position i was accepted
    num_planned_steps: int = 0  # steps that had a sequence to draft for, and the draft tokens chosen over them
    num_planned_seqs: int = 0  # the sequences drafted for over those steps (sequence-steps)
    num_chosen_tokens: int = 0
    last_chosen: float = 0.0  # the mean draft length chosen in the latest such step
    num_proposing_steps: int = 0  # steps whose proposer ran, and the seconds it took over them
    draft_seconds: float = 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verifying step: accepted draft tokens + 1 (1.0 before any draft)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def draft_ms_per_step(self) -> float:
        return 1e3 * self.draft_seconds / self.num_proposing_steps if self.num_proposing_steps else 0.0

    def summary(self) -> str:
        per_position = ", ".join(
            f"{count / self.num_drafts:.2f}" if self.num_drafts else "0" for count in self.accepted_per_position
        )
        return (
            f"speculation: {self.num_drafts} drafts, {self.num_accepted_tokens}/{self.num_draft_tokens} tokens "
            f"accepted, mean accepted length {self.mean_accepted_length:.2f}, acceptance per position "
            f"[{per_position}], draft {self.draft_ms_per_step:.2f} ms/step"
        )


class Speculator:
    def __init__(
        self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int, stop_token_ids: set[int]
    ) -> None:
        self.config, self.proposer, self.max_model_len = config, proposer, max_model_len
        self.stop_token_ids = stop_token_ids
        self.costs = StepCosts()  # the target's decode and verify steps, by query tokens
        self.stats = SpecStats(accepted_per_position=[0] * config.num_speculative_tokens)
        self._accepted, self._trials = 0.0, 0.0  # the proposer's acceptance over all requests (decayed)

    def acceptance(self, seq: Sequence) -> float:
        """Per draft token, the chance it is accepted when the ones before it were: the request's own, from its
        counts, pulled toward the proposer's mean while it has few."""
        prior = (self._accepted + INITIAL_ACCEPTANCE * PRIOR_WEIGHT) / (self._trials + PRIOR_WEIGHT)
        trials = seq.num_accepted_tokens + seq.num_rejections
        return (seq.num_accepted_tokens + prior * PRIOR_WEIGHT) / (trials + PRIOR_WEIGHT)

    def plan(self, batch: ScheduledBatch, block_manager: BlockManager, max_num_batched_tokens: int) -> None:
        """Give drafts to the batch's sequences that sample this step, extending their new tokens."""
        k_max = self.config.num_speculative_tokens
        candidates, rooms = [], []
        for index, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            # Decodes only: a draft after a prefill chunk would make the prompt's rows part of a longer attention,
            # whose floats differ from those of the prompt alone (on the fast path that can change a token).
            if (
                n != 1
                or seq.num_computed_tokens + n != seq.num_tokens
                or seq.num_candidates is not None
                or seq.score_prompt
            ):
                continue
            # Drafts past max_tokens or the context would be computed for nothing.
            room = min(
                k_max, seq.params.max_tokens - seq.num_output_tokens - 1, self.max_model_len - seq.num_tokens - 1
            )
            if room > 0:
                candidates.append(index)
                rooms.append(room)
        if not candidates:
            return
        seqs = [batch.seqs[i] for i in candidates]
        sampling = sum(
            seq.num_computed_tokens + n == seq.num_tokens for seq, n in zip(batch.seqs, batch.num_new_tokens)
        )
        alphas = [self.acceptance(s) for s in seqs]

        def choose(limits):
            return choose_draft_lengths(
                alphas, limits, sum(batch.num_new_tokens), sampling, self.costs, self.proposer.costs
            )

        seeded = any(seq.generator is not None for seq in seqs)
        if self.config.adaptive and not seeded and not any(choose(rooms)):
            limits = ks = [0] * len(seqs)  # not even the longest drafts would pay: no lookup, no draft
        else:
            limits = [min(room, limit) for room, limit in zip(rooms, self.proposer.limits(seqs, k_max))]
            ks = limits
            if self.config.adaptive:
                ks = [limit if seq.generator is not None else k for seq, limit, k in zip(seqs, limits, choose(limits))]
        self.stats.num_planned_steps += 1
        self.stats.num_planned_seqs += len(ks)
        self.stats.num_chosen_tokens += sum(ks)
        self.stats.last_chosen = sum(ks) / len(ks)
        if not any(ks):
            return
        budget = max_num_batched_tokens - sum(batch.num_new_tokens)
        started = time.perf_counter()
        drafts = self.proposer.propose(seqs, ks)
        self.stats.num_proposing_steps += 1
        self.stats.draft_seconds += time.perf_counter() - started
        for index, seq, draft in zip(candidates, seqs, drafts):
            draft = self._up_to_a_stop(draft, seq)
            d = min(len(draft), max(budget, 0))
            if d and block_manager.allocate(seq, seq.num_tokens + d):  # else no blocks to spare: it decodes one token
                seq.draft = Draft(draft.token_ids[:d], None if draft.probs is None else draft.probs[:d])
                batch.num_new_tokens[index] += d
                budget -= d
        batch.block_copies += block_manager.take_copies()

    def _up_to_a_stop(self, draft: Draft, seq: Sequence) -> Draft:
        """The draft up to its first stop token (the sequence ends there: nothing after it is verified)."""
        for i, token in enumerate(draft.token_ids):
            if token in self.stop_token_ids or token in seq.params.stop_token_ids:
                return Draft(draft.token_ids[: i + 1], None if draft.probs is None else draft.probs[: i + 1])
        return draft

    def propose(self, batch: ScheduledBatch, block_manager: BlockManager, max_num_batched_tokens: int) -> None:
        """plan(), or, should the proposer fail, no drafts: the step runs without them."""
        planned = list(batch.num_new_tokens)
        try:
            self.plan(batch, block_manager, max_num_batched_tokens)
        except Exception:
            logger.exception("proposing draft tokens failed: this step runs without them")
            for seq in batch.seqs:
                seq.draft = None
            batch.num_new_tokens[:] = planned

    def record(
        self,
        batch: ScheduledBatch,
        num_sampled: list[int | None],
        decode: tuple[int, float] | None,
        hidden: torch.Tensor | None = None,
    ) -> None:
        """After the step, before the scheduler rolls back the rejected tokens: count what each verified draft
        got accepted (num_sampled[i]: its accepted tokens and one more; None, failed), and, for a decode-only step
        (query tokens, seconds), its cost. `hidden`: the step's final hidden states, for a proposer that wants
        them (Proposer.observe)."""
        if hidden is not None:
            self.proposer.observe(batch, num_sampled, hidden)
        for seq, got in zip(batch.seqs, num_sampled):
            if seq.draft is None or got is None:
                continue
            d, accepted = len(seq.draft), got - 1
            seq.num_drafts += 1
            seq.num_draft_tokens += d
            seq.num_accepted_tokens += accepted
            seq.num_rejections += accepted < d
            stats = self.stats
            stats.num_drafts += 1
            stats.num_draft_tokens += d
            stats.num_accepted_tokens += accepted
            for i in range(accepted):
                stats.accepted_per_position[i] += 1
            self._accepted = 0.99 * self._accepted + accepted
            self._trials = 0.99 * self._trials + accepted + (accepted < d)
        if decode is not None:
            self.costs.observe(*decode)

    def release(self, seq: Sequence) -> None:
        seq.draft = None
        self.proposer.release(seq)
