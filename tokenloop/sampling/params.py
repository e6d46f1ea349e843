"""SamplingParams: how one request chooses its tokens and when it stops (mirrors vLLM's)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
# Temperatures below this are greedy (as vLLM's _SAMPLING_EPS): dividing logits by them overflows.
SAMPLING_EPS = 1e-5
# Seeds are signed 64-bit integers, as OpenAI's API documents them (torch's generators take [-2^63, 2^64)).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(slots=True)
class SamplingParams:
    n: int = 1  # completions per prompt; they share the prompt's KV blocks
    temperature: float = 1.0  # 0 (below SAMPLING_EPS) means greedy
    top_p: float = 1.0  # keep the smallest set of tokens whose probability mass reaches top_p; 1 = off
    top_k: int = -1  # keep the k most likely tokens; -1 (or 0) = off
    min_p: float = 0.0  # drop tokens less likely than min_p × the top token's probability; 0 = off
    seed: int | None = None  # per-request generator: same seed, same tokens, whatever the batch
    max_tokens: int | None = 16  # None = up to the context length
    stop: list[str] = field(default_factory=list)  # strings that end the output; not returned in the text
    stop_token_ids: list[int] = field(default_factory=list)  # tokens that end the output besides EOS
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top log-probabilities per output token (0..20), besides the chosen one
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n}")
        if isinstance(self.temperature, bool) or not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off), 0 (off) or a positive integer, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens}")
        if self.logprobs is not None and not (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.seed is not None and not (_is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX):
            raise ValueError(f"seed must be an integer in [-2^63, 2^63 - 1], got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS
