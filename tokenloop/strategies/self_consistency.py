"""Self-consistency: sample n continuations of one prompt (forked, sharing its KV blocks) and vote on the answer
each gives. The answer is read by a regex with one group, or is the "answer" field of a JSON schema that the
samples are constrained to. Counting stops as soon as no answer can overtake the leader: the samples still
running are aborted, their blocks freed.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

from tokenloop.outputs import CompletionOutput, RequestOutput
from tokenloop.sampling.params import SamplingParams
from tokenloop.sampling.structured import StructuredOutputsParams


@dataclass(slots=True)
class AnswerSpec:
    """How to read a sample's answer: `regex` (exactly one group) or `schema` (a JSON schema with an "answer"
    property)."""

    regex: str | None = None
    schema: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if (self.regex is None) == (self.schema is None):
            raise ValueError("answer: give a regex with one group, or a JSON schema with an 'answer' property")
        if self.regex is not None:
            try:
                groups = re.compile(self.regex).groups
            except re.error as e:
                raise ValueError(f"answer: the regex does not compile: {e}") from None
            if groups != 1:
                raise ValueError(f"answer: the regex must have exactly one group, it has {groups}")
        elif "answer" not in (self.schema.get("properties") or {}):
            raise ValueError("answer: the schema must have an 'answer' property")

    @classmethod
    def of(cls, answer: str | dict[str, Any] | AnswerSpec) -> AnswerSpec:
        if isinstance(answer, AnswerSpec):
            return answer
        return cls(schema=answer) if isinstance(answer, dict) else cls(regex=answer)

    def params(self, params: SamplingParams, n: int) -> SamplingParams:
        """The samples' params: n of them, constrained to the schema when there is one."""
        structured = StructuredOutputsParams(json=self.schema) if self.schema is not None else params.structured_outputs
        return replace(params, n=n, structured_outputs=structured)

    def read(self, text: str) -> str | None:
        """The sample's answer, or None when it gave none (no match, or not the schema's JSON)."""
        if self.regex is not None:
            found = re.findall(self.regex, text)
            return found[-1].strip() if found else None  # the last one: a reasoning chain ends with its answer
        try:
            value = json.loads(text)["answer"]
        except (json.JSONDecodeError, KeyError, TypeError):
            return None
        return value.strip() if isinstance(value, str) else json.dumps(value)


@dataclass(slots=True)
class Vote:
    answer: str | None  # the most voted answer (the first to reach its count wins a tie); None if no sample answered
    votes: dict[str, int]  # answer -> samples that gave it, most first
    confidence: float  # the winner's share of the samples that answered
    samples: list[CompletionOutput]  # the finished samples, in the order they finished
    winner: CompletionOutput | None  # the first finished sample that gave the winning answer
    stopped_early: bool  # the remaining samples were aborted: they could not change the winner


@dataclass(slots=True)
class VoteCounter:
    """Counts the answers of one request's n samples as they finish (feed it each RequestOutput)."""

    spec: AnswerSpec
    n: int
    counts: Counter = field(default_factory=Counter)
    samples: list[CompletionOutput] = field(default_factory=list)
    answers: list[str | None] = field(default_factory=list)
    seen: set[int] = field(default_factory=set)

    def update(self, out: RequestOutput) -> bool:
        """Take the samples finished in `out`; True once the vote is decided."""
        for c in out.outputs:
            if c.finish_reason is not None and c.index not in self.seen:
                self.seen.add(c.index)
                answer = self.spec.read(c.text)
                self.samples.append(c)
                self.answers.append(answer)
                if answer is not None:
                    self.counts[answer] += 1
        return self.decided

    @property
    def decided(self) -> bool:
        remaining = self.n - len(self.samples)
        if remaining == 0:
            return True
        top = self.counts.most_common(2)
        leader, runner_up = (top[0][1] if top else 0), (top[1][1] if len(top) > 1 else 0)
        return leader > runner_up + remaining  # even if every remaining sample gave the runner-up, it stays behind

    def result(self) -> Vote:
        # most_common keeps first-counted order among equal counts: the first to reach its count wins a tie
        votes = dict(self.counts.most_common())
        answer = next(iter(votes), None)
        answered = sum(votes.values())
        winner = next((c for c, a in zip(self.samples, self.answers) if a == answer and answer is not None), None)
        return Vote(
            answer,
            votes,
            votes[answer] / answered if answer is not None else 0.0,
            list(self.samples),
            winner,
            stopped_early=len(self.samples) < self.n,
        )
