"""Skeleton-of-thought: one sequence writes a short outline of the answer (a grammar keeps it to 3-5 numbered
points), then every point is expanded by a sequence forked off the outline's (sharing the question-and-outline
blocks; only the request to expand its point is computed), all in the same steps; the answer is the expansions
in the outline's order.
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
    # (ignore_eos off: once the grammar is complete only EOS may follow, and it must end the outline)
    return replace(
        params, n=1, max_tokens=128, ignore_eos=False, structured_outputs=StructuredOutputsParams(regex=OUTLINE)
    )


def points_of(outline: str) -> list[str]:
    return [m.group(1).strip() for m in re.finditer(r"^\d\. (.+)$", outline, re.MULTILINE)]


def expansion_conversations(question: str, outline: str, points: list[str]) -> list[list[dict[str, str]]]:
    """One conversation per point; all start with the question and the outline (a shared prefix)."""
    head = outline_conversation(question) + [{"role": "assistant", "content": outline}]
    return [
        head + [{"role": "user", "content": EXPAND_ASK.format(number=i + 1, point=point)}]
        for i, point in enumerate(points)
    ]


def expansion_suffixes(
    tokenizer, outline_prompt: str, outline_token_ids: list[int], conversations: list[list[dict[str, str]]]
) -> list[list[int]]:
    """The tokens each expansion adds after the outline's own (prompt and output, its end of turn included), read
    off the chat template: ValueError if the template does not write the expansions' prompts that way."""
    written = outline_prompt + tokenizer.decode(outline_token_ids, skip_special_tokens=False)
    suffixes = []
    for conversation in conversations:
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
        if not text.startswith(written):
            raise ValueError("the chat template does not continue the outline's turn as it ended")
        suffixes.append(tokenizer.encode(text[len(written) :], add_special_tokens=False))
    return suffixes


def assemble(points: list[str], expansions: list[str]) -> Skeleton:
    return Skeleton("\n\n".join(e.strip() for e in expansions), points, expansions)
