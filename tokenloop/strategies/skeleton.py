"""Skeleton-of-thought: one sequence writes a short outline of the answer (a grammar keeps it to 3-5 numbered
points), then every point is expanded by its own sequence, all in the same steps; the answer is the expansions
in the outline's order. The expansions' prompts share the question and the outline, which they read from the
prefix cache (every full block of it) instead of computing it again.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from tokenloop.sampling.params import SamplingParams
from tokenloop.sampling.structured import StructuredOutputsParams

POINT = r"[^\n]{3,60}"
# Three to five numbered points, one a line: the outline is short, so its expansions are what takes the time.
OUTLINE = rf"1\. {POINT}\n2\. {POINT}\n3\. {POINT}(\n4\. {POINT})?(\n5\. {POINT})?"
OUTLINE_ASK = "Do not answer yet. Write only the skeleton of the answer: 3 to 5 numbered points of a few words each."
EXPAND_ASK = "Now write point {number} ({point}) in one or two sentences. Write only that point."


@dataclass(slots=True)
class Skeleton:
    answer: str  # the expansions, in order, one paragraph each
    points: list[str]
    expansions: list[str]


def outline_conversation(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{question}\n\n{OUTLINE_ASK}"}]


def outline_params(params: SamplingParams) -> SamplingParams:
    return replace(params, n=1, max_tokens=128, structured_outputs=StructuredOutputsParams(regex=OUTLINE))


def points_of(outline: str) -> list[str]:
    return [m.group(1).strip() for m in re.finditer(r"^\d\. (.+)$", outline, re.MULTILINE)]


def expansion_conversations(question: str, outline: str, points: list[str]) -> list[list[dict[str, str]]]:
    """One conversation per point; all start with the question and the outline (a shared prefix)."""
    head = outline_conversation(question) + [{"role": "assistant", "content": outline}]
    return [head + [{"role": "user", "content": EXPAND_ASK.format(number=i + 1, point=point)}] for i, point in enumerate(points)]


def assemble(points: list[str], expansions: list[str]) -> Skeleton:
    return Skeleton("\n\n".join(e.strip() for e in expansions), points, expansions)
