"""One row's next-token distribution stage by stage, in the engine's own order: what the explorer shows.

raw logits → each logits processor (sampling/processors.py's PROCESSORS, the same functions the batch runs) →
temperature → min-p → top-k → top-p → the final distribution the draw is made from. A stage is the logits after
that control (-inf: removed so far); the sampler applies top-k and top-p in one sort, shown here one after the
other (the same tokens are kept: top-p is taken over what top-k left).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenloop.sampling.params import SAMPLING_EPS, SamplingParams
from tokenloop.sampling.processors import LogitControls, apply_processors
from tokenloop.sampling.sampler import apply_min_p, apply_top_k_top_p


@dataclass(frozen=True, slots=True)
class Stage:
    name: str
    logits: torch.Tensor  # [V] float32; -inf where removed


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
    if params.temperature < SAMPLING_EPS:
        return [*stages, Stage("final", row[0].log_softmax(dim=-1))]
    row = row / params.temperature
    stages.append(Stage("temperature", row[0].clone()))
    vocab = row.shape[-1]
    if params.min_p > 0.0:
        row = apply_min_p(row, torch.tensor([params.min_p]))
        stages.append(Stage("min_p", row[0].clone()))
    if 0 < params.top_k < vocab:
        row = apply_top_k_top_p(row, torch.tensor([params.top_k]), None)
        stages.append(Stage("top_k", row[0].clone()))
    if params.top_p < 1.0:
        row = apply_top_k_top_p(row, None, torch.tensor([params.top_p]))
        stages.append(Stage("top_p", row[0].clone()))
    stages.append(Stage("final", row[0].log_softmax(dim=-1)))
    return stages
