"""Draft lengths chosen by cost: what a step costs on this machine, and what drafting is expected to return.

A decode step's time is close to linear in the tokens it computes: a fixed part (reading every weight once) plus
a part per query token. `StepCosts` fits seconds = a + b * tokens online, over the engine's own decode and
verify steps (recent steps weigh more: the machine's speed moves, a background compile ends). With acceptance
rate alpha, a sequence given k draft tokens yields 1 + alpha + ... + alpha^k tokens in expectation; the k of
every sequence is chosen to maximise the batch's expected tokens per second, and is 0 where drafting does
not pay (a large batch, whose step is no longer dominated by its fixed part, or a low acceptance rate).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

DECAY = 0.97  # the weight of an observation falls by this factor with each newer one
# Before the fit has seen two different token counts, one query token is taken to cost this fraction of a
# step's fixed part: optimistic enough to try drafting once, after which the fit has its second point.
PRIOR_TOKENS_PER_FIXED_COST = 32
# Drafting must beat not drafting by this fraction of the expected tokens per second: a smaller gain is within
# the error of the estimates it rests on (a request's rate from a few drafts, the fitted line), and a verify
# step measured here costs about that much more than the line says (open chat drafted at a loss without it).
MIN_GAIN = 0.03


@dataclass(slots=True)
class StepCosts:
    """Exponentially weighted least squares of seconds on tokens per step."""

    w: float = 0.0
    x: float = 0.0
    xx: float = 0.0
    y: float = 0.0
    xy: float = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        d = DECAY
        self.w, self.x, self.xx = d * self.w + 1, d * self.x + num_tokens, d * self.xx + num_tokens * num_tokens
        self.y, self.xy = d * self.y + seconds, d * self.xy + num_tokens * seconds

    @property
    def known(self) -> bool:
        return self.w > 0

    def line(self) -> tuple[float, float]:
        """(a, b): seconds = a + b * tokens."""
        if not self.known:
            return 0.0, 0.0
        mean_x, mean_y = self.x / self.w, self.y / self.w
        var = self.xx / self.w - mean_x * mean_x
        if var > 1e-6 * max(1.0, mean_x * mean_x):
            b = (self.xy / self.w - mean_x * mean_y) / var
        else:  # one token count seen so far
            b = mean_y / (mean_x + PRIOR_TOKENS_PER_FIXED_COST)
        b = max(b, 1e-3 * mean_y / max(mean_x, 1.0))  # never free
        return max(mean_y - b * mean_x, 0.0), b

    def seconds(self, num_tokens: int) -> float:
        a, b = self.line()
        return a + b * num_tokens


def choose_draft_lengths(
    alphas: list[float],
    limits: list[int],
    base_tokens: int,
    base_yield: int,
    target: StepCosts,
    draft: StepCosts | None = None,
) -> list[int]:
    """Draft tokens per candidate sequence (each at most limits[i]) maximising expected tokens per second.

    base_tokens: the step's query tokens without drafts; base_yield: the tokens it yields without drafts (one per
    sequence that samples). `draft`: the cost of one draft forward over n sequences (None: drafting is free)."""
    if not target.known:
        return [0] * len(alphas)
    ks = [0] * len(alphas)
    heap = [(-a, i) for i, (a, limit) in enumerate(zip(alphas, limits)) if limit > 0 and a > 0]
    heapq.heapify(heap)
    tokens, expected = base_tokens, float(base_yield)
    per_depth: list[int] = []  # sequences drafting at depth j (each depth is one draft forward)
    draft_seconds = 0.0
    base_rate = expected / target.seconds(tokens)
    best_rate, picks, best_picks = base_rate, [], 0
    while heap:
        gain, i = heapq.heappop(heap)
        ks[i] += 1
        picks.append(i)
        tokens, expected = tokens + 1, expected - gain
        if draft is not None:
            depth = ks[i] - 1
            if depth == len(per_depth):
                per_depth.append(0)
            before = draft.seconds(per_depth[depth]) if per_depth[depth] else 0.0
            per_depth[depth] += 1
            draft_seconds += draft.seconds(per_depth[depth]) - before
        rate = expected / (target.seconds(tokens) + draft_seconds)
        if rate > best_rate:
            best_rate, best_picks = rate, len(picks)
        elif draft is None:
            break  # each next token gains less at the same cost: the rate only falls from here
        if ks[i] < limits[i]:
            heapq.heappush(heap, (gain * alphas[i], i))
    chosen = [0] * len(alphas)
    if best_rate < base_rate * (1 + MIN_GAIN):
        return chosen
    for i in picks[:best_picks]:
        chosen[i] += 1
    return chosen
