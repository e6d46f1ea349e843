"""A step as the explorer shows it: the stages of its distribution (sampling/stages.py, the sampler's own
functions over the step's raw logits), each as its top candidates with logit, probability and kept, and how the
token was chosen (argmax, the seeded draw found again, a pick, a verified draft)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tokenloop.engine.trace import TraceStep, redraw
from tokenloop.sampling.params import SamplingParams
from tokenloop.sampling.processors import LogitControls
from tokenloop.sampling.stages import Stage, distribution_stages, final_probs


@dataclass(frozen=True, slots=True)
class StepContext:
    """What recomputing a step's stages needs besides its raw logits: the sequence before it, the params and
    where the request's output began (penalties, min_tokens and the grammar count from there)."""

    history: list[int]
    params: SamplingParams
    num_prompt_tokens: int


def stages_of(step: TraceStep, ctx: StepContext, encode, eos_token_ids, grammars) -> list[Stage]:
    controls = LogitControls.for_request(
        ctx.params,
        ctx.num_prompt_tokens,
        encode,
        eos_token_ids,
        grammars() if ctx.params.structured_outputs is not None else None,
    )
    return distribution_stages(step.raw, ctx.params, ctx.history, controls)


def entropy(logits: torch.Tensor) -> float:
    logp = logits.double().log_softmax(dim=-1)  # summed over a vocabulary: float32 would drift
    p = logp.exp()
    return float(-(p * logp.nan_to_num(neginf=0.0)).sum())


def token_stats(stages: list[Stage], token_id: int) -> tuple[float, float, int]:
    """The chosen token's probability in the final distribution, that distribution's entropy, and the token's rank
    in the raw one (tokens at least as likely, as vLLM counts it)."""
    raw = stages[0].logits
    return float(final_probs(stages)[token_id]), entropy(stages[-1].logits), int((raw >= raw[token_id]).sum())


def summarize(stages: list[Stage], top_n: int, chosen: int) -> tuple[list[int], list[dict]]:
    """The candidates (each stage's top_n, in order of first appearance, raw first; the chosen token always) and
    per stage, aligned with them: logit (None where removed), p, kept; and num_kept, the mass it removed, entropy
    and logsumexp."""
    candidates: list[int] = []
    for stage in stages:
        finite = torch.isfinite(stage.logits)
        k = min(top_n, int(finite.sum()))
        for token in stage.logits.topk(k).indices.tolist() if k else []:
            if token not in candidates:
                candidates.append(token)
    if chosen not in candidates:
        candidates.append(chosen)
    index = torch.tensor(candidates, dtype=torch.int64)
    out, previous = [], None
    for stage in stages:
        logits = stage.logits
        finite = torch.isfinite(logits)
        probs = logits.double().softmax(dim=-1)  # masses summed over up to 262k tokens: float32 drifts past 1
        removed = 0.0 if previous is None else float(previous[0][previous[1] & ~finite].sum())
        chosen_logits = logits[index].tolist()
        out.append(
            {
                "name": stage.name,
                "num_kept": int(finite.sum()),
                "removed_mass": removed,
                "entropy": entropy(logits),
                "logsumexp": float(logits.logsumexp(dim=-1)),
                "logit": [x if math.isfinite(x) else None for x in chosen_logits],
                "p": probs[index].tolist(),
                "kept": finite[index].tolist(),
            }
        )
        previous = (probs, finite)
    return candidates, out


def how_chosen(step: TraceStep | None, params: SamplingParams, forced: bool) -> str:
    if forced:
        return "forced"
    if step is not None and step.verified is not None:
        return step.verified
    return "argmax" if params.greedy else "draw"


def draw_of(step: TraceStep, stages: list[Stage], token_id: int) -> tuple[float, float] | None:
    """A seeded draw's winner: its exponential q and key p/q (the largest key wins); None if the step kept no
    generator state."""
    if step.rng_state is None:
        return None
    probs = final_probs(stages)
    q = float(redraw(step, probs)[token_id])
    return q, float(probs[token_id]) / q
