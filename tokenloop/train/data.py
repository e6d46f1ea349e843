"""Training examples from JSONL: each line's token ids and which of them are targets, every line checked before
training starts.

Three shapes of line: {"text"} (every token a target), {"prompt", "completion"} (the completion and the EOS after it)
and {"messages"} (the model's chat template; the assistant turns). The prompt is encoded as serving encodes one, so
the model learns on the very ids it will be asked with (BOS where the tokenizer adds it, as Gemma 3's does).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenloop.tokenizer.tokenizer import Tokenizer

SHAPES = "'text', 'prompt' and 'completion', or 'messages'"


@dataclass(frozen=True, slots=True)
class Example:
    """One line's tokens. scored[i]: token i is a target, its loss counted when it is predicted from tokens < i."""

    token_ids: tuple[int, ...]
    scored: tuple[bool, ...]
    line: int  # 1-based line of the JSONL file, for errors and logs

    def __post_init__(self) -> None:
        if len(self.token_ids) < 2:
            raise ValueError(f"token_ids must hold at least 2 tokens (one to predict from), got {len(self.token_ids)}")
        if len(self.scored) != len(self.token_ids):
            raise ValueError(f"scored must be as long as token_ids ({len(self.token_ids)}), got {len(self.scored)}")
        if self.scored[0]:
            raise ValueError("scored[0] must be False: no token comes before the first to predict it")
        if not any(self.scored):
            raise ValueError("scored must mark at least one token")
        if self.line < 1:
            raise ValueError(f"line must be >= 1, got {self.line}")

    @property
    def num_scored(self) -> int:
        return sum(self.scored)


def load_examples(path: str | Path, tokenizer: Tokenizer, max_len: int) -> list[Example]:
    """Every non-blank line of a JSONL file as an Example. Any bad line (not JSON, not an object, an unknown shape, a
    missing, mistyped or empty field, no assistant turn, more than max_len tokens) raises a ValueError naming the file
    and the line, before anything is returned: no training starts on bad data. max_len: the model's context."""
    if max_len < 2:
        raise ValueError(f"max_len must be >= 2, got {max_len}")
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no EOS token to end an example with")
    examples = []
    with open(path, "rb") as f:
        for line, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                token_ids, scored = encode_record(_parse(raw), tokenizer)
                if len(token_ids) > max_len:
                    raise ValueError(f"{len(token_ids)} tokens, more than the model's context of {max_len}")
                examples.append(Example(tuple(token_ids), tuple(scored), line))
            except ValueError as e:
                raise ValueError(f"{path} line {line}: {e}") from None
    if not examples:
        raise ValueError(f"{path}: no examples (the file is blank)")
    return examples


def encode_record(record: Any, tokenizer: Tokenizer) -> tuple[list[int], list[bool]]:
    """One parsed line's token ids and scored mask; a ValueError (without the line) says what is wrong with it."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object with {SHAPES}, got a JSON {_json_type(record)}")
    fields = {"text", "prompt", "completion", "messages"} & record.keys()
    if len(fields & {"text", "messages"}) + bool(fields & {"prompt", "completion"}) > 1:
        raise ValueError(f"mixes shapes ({', '.join(sorted(fields))}): give {SHAPES}")
    if "text" in fields:
        return _encode_text(_string(record, "text"), tokenizer)
    if fields & {"prompt", "completion"}:
        for name in ("prompt", "completion"):
            if name not in record:
                raise ValueError(f"missing field '{name}'")
        return _encode_completion(_string(record, "prompt"), _string(record, "completion"), tokenizer)
    if "messages" in fields:
        return _encode_messages(record["messages"], tokenizer)
    raise ValueError(f"expected {SHAPES}; got keys {sorted(record)}")


def _encode_text(text: str, tokenizer: Tokenizer) -> tuple[list[int], list[bool]]:
    # As nanoGPT and TRL train on plain text: the text as encoded (BOS if the tokenizer adds one), then EOS, so the
    # model learns where a document ends. Every token but the first is a target; nothing predicts the first.
    token_ids = tokenizer.encode(text, add_special_tokens=True)
    if not token_ids or token_ids[-1] != tokenizer.eos_token_id:  # a post-processor may have added EOS already
        token_ids = token_ids + [tokenizer.eos_token_id]
    return token_ids, [False] + [True] * (len(token_ids) - 1)


def _encode_completion(prompt: str, completion: str, tokenizer: Tokenizer) -> tuple[list[int], list[bool]]:
    # The prompt as serving encodes it (input_processor._encode); the completion as the model would generate it,
    # without special tokens, then the EOS that stops generation.
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=True)
    completion_ids = tokenizer.encode(completion, add_special_tokens=False)
    if not completion_ids:
        raise ValueError("field 'completion' encodes to no tokens")
    token_ids = prompt_ids + completion_ids + [tokenizer.eos_token_id]
    return token_ids, [False] * len(prompt_ids) + [True] * (len(completion_ids) + 1)


def _encode_messages(messages: Any, tokenizer: Tokenizer) -> tuple[list[int], list[bool]]:
    """The conversation through the chat template. An assistant turn's tokens are those the template adds after the
    generation prompt of the turns before it, up to its last end-of-turn token (an EOS id: what the model emits to
    stop). What follows that (a newline) leads into the next turn and is not the model's to predict."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("field 'messages' must be a non-empty list of messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] must be an object with a string 'role'")
        if message["role"] == "assistant" and not message.get("content") and not message.get("tool_calls"):
            raise ValueError(f"messages[{i}]: the assistant turn is empty")
    assistant_turns = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
    if not assistant_turns:
        raise ValueError("messages has no assistant turn to train on")

    def render(turns: list[dict], add_generation_prompt: bool) -> list[int]:
        return tokenizer.apply_chat_template(turns, add_generation_prompt=add_generation_prompt, tokenize=True)

    token_ids = render(messages, False)
    scored = [False] * len(token_ids)
    for i in assistant_turns:
        before, through = render(messages[:i], True), render(messages[: i + 1], False)
        # Only a template that renders a conversation's start the same whatever follows tells us which ids are the
        # turn's (one that, say, drops earlier turns' reasoning does not).
        if through[: len(before)] != before or token_ids[: len(through)] != through:
            raise ValueError(
                f"messages[{i}]: the chat template is not prefix-stable (the tokens before this assistant turn change "
                "once it is added), so the turn's tokens cannot be told apart"
            )
        ends = [j for j in range(len(before), len(through)) if through[j] in tokenizer.eos_token_ids]
        end = ends[-1] + 1 if ends else len(through)
        if end == len(before):
            raise ValueError(f"messages[{i}]: the chat template writes no tokens for this assistant turn")
        scored[len(before) : end] = [True] * (end - len(before))
    return token_ids, scored


def _parse(raw: bytes) -> Any:
    try:
        return json.loads(raw.decode("utf-8").strip())  # a newline inside an unclosed string is not the error
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e.msg} (column {e.colno})") from None


def _string(record: dict[str, Any], name: str) -> str:
    value = record[name]
    if not isinstance(value, str):
        raise ValueError(f"field '{name}' must be a string, got a JSON {_json_type(value)}")
    if not value:
        raise ValueError(f"field '{name}' is empty")
    return value


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)
