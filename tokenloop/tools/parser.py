"""Reading tool calls out of a reply's text, whole or as it streams (the format of tools/calling.py).

`parse_reply` runs on the text so far and gives what is safe to send: content before the first call (less a
tail that may be the start of "<tool_call>"), and each call's name once its header is complete, with the
arguments text written so far (less a tail that may be the call's closing). Each later parse extends the
earlier one, so streamed deltas add up to the final message.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from tokenloop.tools.calling import CALL_SUFFIX

_HEADER = re.compile(r'\{"name": ("(?:[^"\\]|\\.)*"), "arguments": ')


@dataclass(slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text, complete once `complete`
    complete: bool


@dataclass(slots=True)
class ParsedReply:
    content: str  # the text before the first call
    calls: list[ParsedCall]


def _held_back(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker` (it may yet become it)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def parse_reply(text: str, finished: bool) -> ParsedReply:
    """The reply so far. When `finished`, a call left incomplete (the reply hit max_tokens) is content."""
    first = text.find("<tool_call>")
    if first < 0:
        cut = 0 if finished else _held_back(text, "<tool_call>")
        return ParsedReply(text[: len(text) - cut], [])
    content, calls = text[:first], []
    for block in text[first:].split("<tool_call>")[1:]:
        header = _HEADER.match(block, 1) if block.startswith("\n") else None
        if header is None:
            if finished:  # not a call the grammar wrote: keep the text
                return ParsedReply(text if not calls else content, calls)
            break
        rest = block[header.end() :]
        end = rest.find(CALL_SUFFIX)
        if end >= 0:
            arguments, complete = rest[:end], True
        else:
            arguments, complete = rest[: len(rest) - _held_back(rest, CALL_SUFFIX)], False
        calls.append(ParsedCall(json.loads(header.group(1)), arguments, complete))
    if finished and calls and not calls[-1].complete:
        calls.pop()
        if not calls:
            return ParsedReply(text, [])
    return ParsedReply(content, calls)
