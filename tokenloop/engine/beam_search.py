"""Beam search with transformers' semantics: keep the beam_width most probable continuations of a prompt.

Each step, every live beam's row gives its top K next tokens (K = (1 + number of EOS ids) × beam_width, so
that beam_width of them are not EOS), scored by the beam's cumulative logprob plus the token's. Of the best K
over all beams: a candidate that ends (EOS, or the length limit reached) and ranks within the top beam_width
becomes a finished hypothesis, scored cumulative logprob / generated length ** length_penalty (the best
beam_width are kept); the best beam_width that do not end are the next live beams. The search stops once no
live beam can beat the worst kept hypothesis (`early_stopping`: False estimates with the current length,
"never" with the longest possible when length_penalty > 0, True stops as soon as beam_width are kept), or at
the length limit. The beams are sequences of the engine: forked from their parent (sharing its KV blocks) and
run in the same steps as every other request. This module holds the arithmetic; the engine does the forks.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from tokenloop.engine.sequence import Sequence
from tokenloop.sampling.params import SamplingParams

MAX_BEAM_WIDTH = 64


@dataclass(slots=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int = 16
    length_penalty: float = 1.0  # scores are divided by generated length ** length_penalty
    early_stopping: bool | str = False  # True, False or "never", as transformers
    ignore_eos: bool = False  # EOS is then a token like any other
    n: int | None = None  # beams returned, best first; None = beam_width

    def __post_init__(self) -> None:
        if (
            isinstance(self.beam_width, bool)
            or not isinstance(self.beam_width, int)
            or not 1 <= self.beam_width <= MAX_BEAM_WIDTH
        ):
            raise ValueError(f"beam_width must be an integer in [1, {MAX_BEAM_WIDTH}], got {self.beam_width!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if (
            isinstance(self.length_penalty, bool)
            or not isinstance(self.length_penalty, int | float)
            or not math.isfinite(self.length_penalty)
        ):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        if self.n is None:
            self.n = self.beam_width
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= self.beam_width:
            raise ValueError(f"n must be an integer in [1, beam_width={self.beam_width}], got {self.n!r}")

    def sampling_params(self) -> SamplingParams:
        """What each beam's sequence runs with: greedy rows (their top K is what counts), up to max_tokens."""
        return SamplingParams(temperature=0, max_tokens=self.max_tokens, ignore_eos=self.ignore_eos)


@dataclass(slots=True)
class Beam:
    seq: Sequence
    logprob: float  # cumulative logprob of its generated tokens


@dataclass(slots=True)
class Hypothesis:
    token_ids: list[int]  # generated tokens, the ending one included
    logprob: float
    score: float  # logprob / len(token_ids) ** length_penalty
    ended_by_eos: bool


@dataclass(slots=True)
class Continuation:
    """A next live beam: its parent's tokens and this one."""

    parent: Beam
    token_id: int
    logprob: float


@dataclass(slots=True)
class BeamSearch:
    params: BeamSearchParams
    eos_token_ids: frozenset[int]
    beams: list[Beam]  # live, best first
    num_generated: int = 0
    finished: list[Hypothesis] = field(default_factory=list)  # the best beam_width ended ones, best first
    improvable: bool = True  # a live beam may still beat the worst kept hypothesis
    done: bool = False
    rows: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)  # this step's top K per live beam
    beam_ids: itertools.count = field(default_factory=lambda: itertools.count(1))  # of forked beams, within the request

    @property
    def num_candidates(self) -> int:
        """K: how many of its row's best tokens each live beam needs."""
        return (1 + (0 if self.params.ignore_eos else len(self.eos_token_ids))) * self.params.beam_width

    def add_row(self, seq: Sequence, token_ids: list[int], logprobs: list[float]) -> None:
        self.rows[seq.seq_id] = (token_ids[: self.num_candidates], logprobs[: self.num_candidates])

    @property
    def ready(self) -> bool:
        """Every live beam has its row: the step's candidates can be ranked."""
        return all(beam.seq.seq_id in self.rows for beam in self.beams)

    def advance(self) -> list[Continuation]:
        """Rank the candidates of every live beam: keep the hypotheses that end, return the next live beams."""
        width, k = self.params.beam_width, self.num_candidates
        candidates = sorted(
            (
                (beam.logprob + lp, i, token)
                for i, beam in enumerate(self.beams)
                for token, lp in zip(*self.rows[beam.seq.seq_id])
            ),
            key=lambda c: -c[0],
        )[:k]
        self.rows.clear()
        length = self.num_generated + 1  # of every candidate, its token included
        at_limit = length >= self.params.max_tokens
        continuations = []
        eos = lambda token: token in self.eos_token_ids and not self.params.ignore_eos  # noqa: E731
        # Whether hypotheses may still be kept this step: decided before it adds any, as transformers does.
        keeping = self.improvable and not (len(self.finished) == width and self.params.early_stopping is True)
        for rank, (logprob, i, token) in enumerate(candidates):
            parent = self.beams[i]
            if not (at_limit or eos(token)):
                if len(continuations) < width:
                    continuations.append(Continuation(parent, token, logprob))
            elif rank < width and keeping:
                tokens = parent.seq.output_token_ids + [token]
                self._keep(Hypothesis(tokens, logprob, logprob / length**self.params.length_penalty, eos(token)))
        self.num_generated = length
        if continuations and len(self.finished) == width:
            best = continuations[0].logprob
            longest = (
                self.params.max_tokens
                if self.params.early_stopping == "never" and self.params.length_penalty > 0
                else length
            )
            self.improvable = self.improvable and best / longest**self.params.length_penalty > self.finished[-1].score
        full = len(self.finished) == width and self.params.early_stopping is True
        self.done = at_limit or not self.improvable or full or not continuations
        return [] if self.done else continuations

    def _keep(self, hypothesis: Hypothesis) -> None:
        self.finished.append(hypothesis)
        self.finished.sort(key=lambda h: -h.score)  # stable: an earlier one wins a tie, as transformers' merge
        del self.finished[self.params.beam_width :]

    def best(self) -> list[Hypothesis]:
        return self.finished[: self.params.n]
