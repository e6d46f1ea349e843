"""Request outputs, shaped like vLLM's: RequestOutput → CompletionOutput(s) → per-token Logprob dicts."""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from typing import Any


class Prefix(SequenceABC):
    """items[start:stop] of a list that only ever grows, seen read-only: what each step's output carries instead of
    a copy (a copy of a completion's tokens every step costs O(L²) over its length). What it shows never changes,
    so it can cross threads while the engine appends to the list; it compares, prints and pickles as a list."""

    __slots__ = ("_items", "_start", "_stop")

    def __init__(self, items: list, start: int = 0, stop: int | None = None) -> None:
        self._items, self._start, self._stop = items, start, len(items) if stop is None else stop

    def __len__(self) -> int:
        return self._stop - self._start

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self._items[i] for i in range(self._start, self._stop)[index]]
        return self._items[range(self._start, self._stop)[index]]

    def __iter__(self) -> Iterator:
        return (self._items[i] for i in range(self._start, self._stop))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, list | Prefix) and len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]  # as a list's

    def __add__(self, other: Any) -> list:
        return list(self) + list(other)

    def __radd__(self, other: Any) -> list:
        return list(other) + list(self)

    def __repr__(self) -> str:
        return repr(list(self))

    def __reduce__(self):
        return list, (list(self),)


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None  # 1-based rank in the model's distribution
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: SequenceABC[int]  # a list, or a Prefix of the engine's (as a list to read)
    cumulative_logprob: float | None
    logprobs: SequenceABC[dict[int, Logprob]] | None  # per output token: chosen token and the top-k, by token id
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
    prompt_logprobs: SequenceABC[dict[int, Logprob] | None] | None = None
    error: str | None = None  # set (with finished) when the engine failed this request alone
    speculative: SpeculativeUsage | None = None  # where the engine decodes speculatively
