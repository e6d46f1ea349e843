"""Fault injection, for tests: one engine stage fails (or stalls) for the sequences whose prompt holds a marker token.

`tokenloop serve --inject-fault STAGE:TOKEN_ID` (repeatable) sets it on a real server process, so that a test can
check that a failure tied to one request fails that request alone, and that /health notices a stalled step loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tokenloop.engine.sequence import Sequence

# Where the step calls inject() (engine/executor.py, engine/output_processor.py): building the step's tensors,
# sampling, turning tokens into text;
# "stall" sleeps inside the request's first step instead of raising; "die" ends the step thread.
STAGES = ("prepare", "sample", "detokenize", "stall", "die")


class InjectedFault(RuntimeError):
    pass


class StepThreadKilled(BaseException):
    """Injected: escapes every `except Exception`, as a bug in the step loop itself would, and ends the step thread."""


@dataclass(slots=True, frozen=True)
class FaultInjection:
    stage: str
    token_id: int
    stall_s: float = 8.0

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"fault stage must be one of {', '.join(STAGES)}, got {self.stage!r}")

    @classmethod
    def parse(cls, spec: str) -> FaultInjection:
        """'STAGE:TOKEN_ID', e.g. 'sample:399'."""
        stage, _, token = spec.partition(":")
        if not token.isdigit():
            raise ValueError(f"inject_fault must be STAGE:TOKEN_ID, got {spec!r}")
        return cls(stage, int(token))

    def check(self, stage: str, seq: Sequence) -> None:
        if stage != self.stage or self.token_id not in seq.token_ids[: seq.num_prompt_tokens]:
            return
        if stage == "stall":
            if seq.num_computed_tokens == 0:  # once per request: its first step
                time.sleep(self.stall_s)
            return
        if stage == "die":
            raise StepThreadKilled(f"injected: the step thread dies in {seq.seq_id}'s step")
        raise InjectedFault(f"injected fault in {stage} of {seq.seq_id}")


def inject(faults: list[FaultInjection], stage: str, seqs: list[Sequence]) -> None:
    """Where a stage of the step may fail (or stall) for a test's marked sequences."""
    for fault in faults:
        for seq in seqs:
            fault.check(stage, seq)
