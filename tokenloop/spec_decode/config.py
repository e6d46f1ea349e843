"""SpeculativeConfig: which proposer drafts tokens and how many at most (vLLM's `speculative_config` shape)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft", "eagle")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(slots=True)
class SpeculativeConfig:
    # "ngram" (prompt lookup), "draft" (a smaller or cheaper model with the same vocabulary) or "eagle" (a one-layer
    # head over the target's features: models/eagle.py)
    method: str
    # The most draft tokens per sequence and step; the cost model (spec_decode/cost_model.py) chooses at most this many.
    num_speculative_tokens: int = 4
    # False: every sequence drafts num_speculative_tokens each step (vLLM's rule), never fewer for cost.
    adaptive: bool = True
    prompt_lookup_min: int = 1  # ngram: the shortest suffix matched against the sequence's earlier tokens
    prompt_lookup_max: int = 4  # ngram: the longest (tried first)
    # draft: name, .gguf file or Hugging Face folder; None = the target's own model. eagle: the drafter's folder;
    # None = the drafter tokenloop ships for the target (models/eagle.py: SHIPPED_DRAFTERS).
    model: str | None = None
    dtype: str = "auto"  # draft: its dtype ("auto" = the 4-bit fast path); the target keeps its own

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)}, got {self.method!r}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config.num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], "
                f"got {k!r}"
            )
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config.adaptive must be true or false, got {self.adaptive!r}")
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config.{name} must be an integer >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) "
                f"must not exceed prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if self.method == "ngram" and self.model is not None:
            raise ValueError(
                "speculative_config.model is for method 'draft'; 'ngram' looks tokens up in the sequence itself"
            )

    @classmethod
    def of(cls, value: SpeculativeConfig | dict[str, Any]) -> SpeculativeConfig:
        """From a config or its dict (the JSON of `tokenloop serve --speculative-config`); unknown keys are errors."""
        if isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(value) - known):
            raise ValueError(f"speculative_config has unknown keys {unknown}; known: {sorted(known)}")
        if "method" not in value:
            raise ValueError(f"speculative_config.method is required: one of {', '.join(METHODS)}")
        return cls(**value)
