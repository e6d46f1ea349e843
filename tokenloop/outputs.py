"""Request outputs, shaped like vLLM's: RequestOutput → CompletionOutput(s) → per-token Logprob dicts."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None  # 1-based rank in the model's distribution
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None  # per output token: chosen token and the top-k, by token id
    finish_reason: str | None = None  # "stop", "length", "abort" (ended by the server) or None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class SpeculativeUsage:
    """A request's speculative decoding, over its completions: drafts verified, their tokens, those accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verifying step: the accepted draft tokens and the one more each step yields."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def add(self, other: SpeculativeUsage) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # With SamplingParams.prompt_logprobs: per prompt token its logprob and the top k (None for the first token)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    error: str | None = None  # set (with finished) when the engine failed this request alone
    speculative: SpeculativeUsage | None = None  # where the engine decodes speculatively
