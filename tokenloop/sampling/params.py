"""SamplingParams: how one request chooses its tokens and when it stops (mirrors vLLM's)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tokenloop.sampling.structured import StructuredOutputsParams

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
    # Logprobs of each prompt token, and the top k at its position (0..20): what evaluation harnesses score.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Logits processors (sampling/processors.py), applied in this order before the greedy choice or sampling:
    allowed_token_ids: list[int] | None = None  # only these tokens may be chosen
    bad_words: list[str] = field(default_factory=list)  # words never to end the output with
    min_tokens: int = 0  # EOS and stop_token_ids are banned until the output has this many tokens
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    repetition_penalty: float = 1.0  # > 1 discourages any token of the prompt or output; 1 = off
    presence_penalty: float = 0.0  # subtracted once from a token that appeared in the output, in [-2, 2]
    frequency_penalty: float = 0.0  # subtracted per appearance in the output, in [-2, 2]
    no_repeat_ngram_size: int = 0  # no n-gram of this size appears twice (prompt included); 0 = off
    structured_outputs: StructuredOutputsParams | None = (
        None  # a grammar every token must follow (sampling/structured.py)
    )
    # Keep each step's raw logits on the sequence (engine/trace.py): what the explorer shows. Changes no token.
    trace: bool = False

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
        if self.prompt_logprobs is not None and not (
            _is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        if self.seed is not None and not (_is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX):
            raise ValueError(f"seed must be an integer in [-2^63, 2^63 - 1], got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
            if not self.allowed_token_ids or any(not _is_int(t) or t < 0 for t in self.allowed_token_ids):
                raise ValueError(
                    "allowed_token_ids must be a non-empty list of non-negative integers, "
                    f"got {self.allowed_token_ids!r}"
                )
        self.bad_words = list(self.bad_words or [])
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise ValueError(f"bad_words must be non-blank strings, got {self.bad_words!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logit_bias is not None:
            self.logit_bias = dict(self.logit_bias)
            for token, bias in self.logit_bias.items():
                if not _is_int(token) or token < 0:
                    raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
                if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
                    raise ValueError(
                        f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token {token}"
                    )
        if isinstance(self.repetition_penalty, bool) or not (
            self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)
        ):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(
                f"structured_outputs must be a StructuredOutputsParams, got {type(self.structured_outputs).__name__}"
            )
        if not isinstance(self.trace, bool):
            raise ValueError(f"trace must be a bool, got {self.trace!r}")
        if not _is_int(self.no_repeat_ngram_size) or self.no_repeat_ngram_size < 0:
            raise ValueError(f"no_repeat_ngram_size must be an integer >= 0, got {self.no_repeat_ngram_size!r}")

    @property
    def uses_processors(self) -> bool:
        """Whether any logits processor is on (else the sampler skips them all)."""
        return bool(
            self.allowed_token_ids is not None
            or self.bad_words
            or self.min_tokens
            or self.logit_bias
            or self.repetition_penalty != 1.0
            or self.presence_penalty
            or self.frequency_penalty
            or self.no_repeat_ngram_size
            or self.structured_outputs is not None
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS
