"""A traced sequence's record of each step: the raw logits its token was chosen from, and what the draw needs to
be shown again (the explorer, tokenloop/explorer/, reads it; SamplingParams.trace turns it on).

Only traced sequences pay for it: one copy of a logits row per token. Every stage of the distribution is then
recomputed from the raw row by the sampler's own functions (sampling/stages.py), never kept twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tokenloop.sampling.sampler import exponential_race

if TYPE_CHECKING:
    from tokenloop.engine.sequence import Sequence


@dataclass(slots=True)
class TraceStep:
    raw: torch.Tensor  # [V] float32: the raw logits at this position
    # The request's generator before this step's draw (a seeded row that drew alone): the draw's exponentials
    # are drawn again from it. None for greedy rows, unseeded ones and verified drafts (a different draw).
    rng_state: torch.Tensor | None
    # How a verified draft's position got its token: "accepted", "recovery" (a rejection's resample) or "bonus"
    # (every draft token accepted); None for an ordinary step (argmax or the draw, as the params say).
    verified: str | None = None
    drafted: list[int] | None = None  # the first position of a verified step: the draft's tokens


def rng_states(seqs: list[Sequence]) -> list[torch.Tensor | None] | None:
    """Before a step's sampling: the generator state of each traced, seeded sequence (None if nothing is traced)."""
    if all(seq.trace is None for seq in seqs):
        return None
    return [seq.generator.get_state() if seq.trace is not None and seq.generator is not None else None for seq in seqs]


def record_steps(
    seqs: list[Sequence], logits: torch.Tensor, counts: list[int] | None, states: list[torch.Tensor | None]
) -> None:
    """After a step's sampling: each traced sequence's new positions. logits [R, V] float32 are the rows sampled
    from, 1 + draft length per sequence in order; counts[i] are the tokens sequence i got (None: one each)."""
    row = 0
    for i, seq in enumerate(seqs):
        draft = seq.draft.token_ids if seq.draft is not None and len(seq.draft) else None
        emitted = counts[i] if counts is not None else 1
        if seq.trace is not None:
            for j in range(emitted):
                verified = None
                if draft is not None:
                    verified = "accepted" if j < emitted - 1 else "bonus" if emitted > len(draft) else "recovery"
                state = states[i] if draft is None and counts is None else None
                seq.trace[seq.num_tokens + j] = TraceStep(
                    logits[row + j].float().clone(), state, verified, list(draft) if draft and j == 0 else None
                )
        row += 1 + (len(draft) if draft is not None else 0)


def redraw(step: TraceStep, probs: torch.Tensor) -> torch.Tensor:
    """[V]: the exponentials q of a seeded step's draw (sampling/sampler.py's exponential race, whose winner is
    argmax(probs / q) over the tokens of nonzero probability), drawn again from the generator state the step kept;
    inf for the tokens that did not race."""
    generator = torch.Generator(probs.device)
    generator.set_state(step.rng_state)
    _, support, q = exponential_race(probs.unsqueeze(0), [generator])
    return torch.full_like(probs, float("inf")).index_copy_(0, support[:, 1], q)
