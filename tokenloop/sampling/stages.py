"""One row's next-token distribution stage by stage, in the engine's own order: what the explorer shows.

raw logits → each logits processor (sampling/processors.py's PROCESSORS, the same functions the batch runs) →
temperature → min-p → top-k → top-p → the final distribution the draw is made from. A stage is the logits after
that control (-inf: removed so far); the sampler applies top-k and top-p in one call, shown here one after the
other (top-p is taken over what top-k left, by that very call).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenloop.sampling.params import SAMPLING_EPS, SamplingParams
from tokenloop.sampling.processors import LogitControls, apply_processors
from tokenloop.sampling.sampler import apply_min_p, apply_top_k_top_p, top_k_top_p


@dataclass(frozen=True, slots=True)
class Stage:
    name: str
    logits: torch.Tensor  # [V] float32; -inf where removed
    probs: torch.Tensor | None = None  # [V] the final stage's: the distribution the draw is made from


def distribution_stages(
    logits: torch.Tensor, params: SamplingParams, token_ids: list[int], controls: LogitControls | None
) -> list[Stage]:
    """The stages of one row ([V] logits of the sequence `token_ids`), each a copy; greedy params go from the
    processors straight to the final stage (its argmax is the choice). `controls` are advanced as a step would
    advance them (a grammar's matcher syncs to token_ids): pass a copy that sampling does not use."""
    row = logits.float().unsqueeze(0)
    stages = [Stage("raw", row[0].clone())]
    if controls is not None:

        def keep(name: str, out: torch.Tensor) -> None:
            if not torch.equal(out[0], stages[-1].logits):  # a processor that changed nothing is no stage
                stages.append(Stage(name, out[0].clone()))

        row = apply_processors(row, [params], [token_ids], [controls], after_each=keep)
    if params.temperature < SAMPLING_EPS:  # the argmax of the processors' logits is the choice
        return [*stages, _final(top_k_top_p(row, None, None)[0])]
    # As Sampler.probs computes them, with the same tensors (a row's floats are then the engine's to the bit).
    row = row / torch.tensor([params.temperature]).unsqueeze(1)
    stages.append(Stage("temperature", row[0].clone()))
    vocab = row.shape[-1]
    if params.min_p > 0.0:
        row = apply_min_p(row, torch.tensor([params.min_p]))
        stages.append(Stage("min_p", row[0].clone()))
    k = torch.tensor([params.top_k]) if 0 < params.top_k < vocab else None
    p = torch.tensor([params.top_p]) if params.top_p < 1.0 else None
    if k is None and p is None:
        return [*stages, _final(top_k_top_p(row, None, None)[0])]
    if k is not None:
        stages.append(Stage("top_k", apply_top_k_top_p(row, k, None)[0]))
    probs = top_k_top_p(row, k, p)  # top-p over what top-k left: the sampler's one call with both
    if p is not None:
        stages.append(Stage("top_p", row[0].masked_fill(probs[0] == 0, float("-inf"))))
    return [*stages, _final(probs[0])]


def _final(probs: torch.Tensor) -> Stage:
    return Stage("final", probs.log(), probs)


def final_probs(stages: list[Stage]) -> torch.Tensor:
    """[V]: the distribution the token is drawn from, as Sampler.probs computes it (greedy settings: the softmax of
    the processors' logits, whose argmax is the choice)."""
    return stages[-1].probs
