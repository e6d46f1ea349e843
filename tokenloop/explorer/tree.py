"""An explore tree as plain data: the prompt, and branches of tokens, each continuing another from a position.

Branch b0 is the first generation from the prompt. A branch with a parent starts at `start`: its sequence is the
parent's first `start` tokens, then its own. Each of its tokens keeps the engine's record of its step (a TraceStep:
the raw logits it was chosen from), the engine request holding its KV blocks while it is resident, and the
segments it was generated in (seed, max_tokens): replaying them gives the same tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tokenloop.engine.trace import TraceStep


@dataclass(slots=True)
class Segment:
    """One engine request that grew a branch: what replaying it needs."""

    seed: int
    max_tokens: int
    num_prompt_tokens: int  # its prompt's length: where its output (penalties, min_tokens, grammar) starts


@dataclass(slots=True)
class Branch:
    id: str
    parent: str | None
    start: int  # absolute position of its first token
    kind: str  # "sample", "branch" (first token picked), "vote" (a self-consistency sample), "beam"
    token_ids: list[int] = field(default_factory=list)
    how: list[str] = field(default_factory=list)  # per token: argmax, draw, forced, accepted, recovery, bonus, beam
    steps: list[TraceStep | None] = field(default_factory=list)  # per token: its step's record (None: beams)
    # Per token: where the output of the request that chose it began (its penalties, min_tokens and grammar count
    # from there: a continuation is a new request whose prompt is the branch so far).
    output_start: list[int] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    p: list[float | None] = field(default_factory=list)  # per token: its probability in the final distribution
    entropy: list[float | None] = field(default_factory=list)  # per token: of the final distribution, in nats
    rank: list[int | None] = field(default_factory=list)  # per token: its rank in the raw distribution
    spec: list[dict | None] = field(default_factory=list)  # per token: a verified draft's record, at its first token
    request_id: str | None = None  # the engine's retained request holding its blocks; None: not resident
    score: float | None = None  # a beam's cumulative logprob
    answer: str | None = None  # a vote sample's answer
    finish_reason: str | None = None

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass(slots=True)
class ExploreTree:
    id: str
    prompt_token_ids: list[int]
    params: dict  # the settings as the API took them (protocol.ExploreParams)
    seed: int
    top_n: int
    max_tokens: int
    branches: dict[str, Branch] = field(default_factory=dict)
    vote: dict | None = None
    beam: dict | None = None  # the last beam search's settings (beam_width, max_tokens)
    next_segment: int = 0  # segment k samples with seed + k
    last_used: float = field(default_factory=time.monotonic)

    def new_branch(self, parent: str | None, start: int, kind: str) -> Branch:
        number = max((int(b[1:]) for b in self.branches), default=-1) + 1  # never an id a deleted branch had
        branch = Branch(f"b{number}", parent, start, kind)
        self.branches[branch.id] = branch
        return branch

    def segment_seed(self) -> int:
        seed, self.next_segment = self.seed + self.next_segment, self.next_segment + 1
        return seed

    def sequence(self, branch: Branch) -> list[int]:
        """The branch's whole sequence: prompt, its ancestors' tokens up to it, its own."""
        if branch.parent is None:
            return self.prompt_token_ids[: branch.start] + branch.token_ids
        return self.sequence(self.branches[branch.parent])[: branch.start] + branch.token_ids

    def owner(self, branch: Branch, position: int) -> tuple[Branch, int] | None:
        """The branch whose own token is at `position` of `branch`'s sequence, and its index there (None: a prompt
        position)."""
        while position < branch.start:
            if branch.parent is None:
                return None
            branch = self.branches[branch.parent]
        if position >= branch.end:
            return None
        return branch, position - branch.start

    def descendants(self, branch_id: str) -> list[Branch]:
        """The branch and every branch continuing it, parents first."""
        found = [self.branches[branch_id]]
        for b in self.branches.values():
            if b.parent is not None and any(b.parent == f.id for f in found) and b not in found:
                found.append(b)
        return found

    def resident(self) -> list[Branch]:
        return [b for b in self.branches.values() if b.request_id is not None]

    def trace_bytes(self) -> int:
        seen = {id(s.raw): s.raw.numel() * s.raw.element_size() for b in self.branches.values() for s in b.steps if s}
        return sum(seen.values())
