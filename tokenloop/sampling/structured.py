"""Structured output: a grammar (JSON schema, any JSON object, regex, Lark, a choice of strings) constrains every
token, through llguidance's matcher (a token mask per step, about 50 us a row).

The grammar is compiled once per spec and engine (`GrammarCompiler`), checked before the request is queued (an
unsupported schema keyword or a bad regex is a ValueError naming the field), and each sequence gets its own
matcher, which reads the sequence's new tokens lazily, as the penalties' history does (so preemption and
recomputation keep it right). Once the grammar is complete the mask allows only EOS: outputs end.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import numpy as np
import torch

# Whitespace between JSON tokens, bounded: models indent their JSON, but unbounded whitespace lets a model that
# has lost its way emit blanks until max_tokens instead of closing the object.
JSON_OPTIONS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,16}"}


@dataclass(slots=True)
class StructuredOutputsParams:
    """vLLM's shape: set exactly one."""

    json: dict | str | None = None  # a JSON schema (dict, or its text)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    grammar: str | None = None  # a Lark grammar (llguidance's dialect)
    choice: list[str] | None = None  # one of these strings, exactly

    def __post_init__(self) -> None:
        chosen = [name for name in ("json", "regex", "grammar", "choice") if getattr(self, name) is not None] + (
            ["json_object"] if self.json_object else []
        )
        if len(chosen) != 1:
            raise ValueError(
                "structured_outputs: set exactly one of json, json_object, regex, grammar, choice "
                f"(got {chosen or 'none'})"
            )
        if self.choice is not None and (not self.choice or any(not isinstance(c, str) or not c for c in self.choice)):
            raise ValueError(
                f"structured_outputs.choice must be a non-empty list of non-empty strings, got {self.choice!r}"
            )
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if self.json is not None and not isinstance(self.json, dict | bool):
            raise ValueError(f"structured_outputs.json must be a JSON schema object, got {type(self.json).__name__}")

    @property
    def field(self) -> str:
        """The name of the one field set (for error messages)."""
        return (
            next(name for name in ("json", "regex", "grammar", "choice") if getattr(self, name) is not None)
            if not self.json_object
            else "json_object"
        )

    def key(self) -> str:
        """A canonical text of the spec: the compile cache's key."""
        value = getattr(self, self.field)
        return f"{self.field}:{json.dumps(value, sort_keys=True)}"


class GrammarCompiler:
    """llguidance's tokenizer for one engine's tokenizer (built once, about a second), and the grammars compiled
    for it, by spec."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]) -> None:
        import llguidance

        self._llguidance = llguidance
        # n_vocab: as wide as the logits (a model's embedding may have more rows than the tokenizer has tokens).
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_token_ids or None)
        self.vocab_size = vocab_size
        self._grammars: dict[str, str] = {}

    def grammar(self, spec: StructuredOutputsParams) -> str:
        """The spec's grammar, checked: ValueError naming the field when llguidance cannot honour it."""
        key = spec.key()
        if (grammar := self._grammars.get(key)) is None:
            matcher = self._llguidance.LLMatcher
            if spec.field == "json" or spec.field == "json_object":
                try:
                    grammar = matcher.grammar_from_json_schema(
                        spec.json if spec.field == "json" else {"type": "object"}, defaults=JSON_OPTIONS
                    )
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json: {e}") from None
            elif spec.field == "regex":
                grammar = matcher.grammar_from_regex(spec.regex)
            elif spec.field == "grammar":
                grammar = matcher.grammar_from_lark(spec.grammar)
            else:
                grammar = matcher.grammar_from_regex("(" + "|".join(re.escape(c) for c in spec.choice) + ")")
            error = matcher.validate_grammar(grammar, self.tokenizer)
            if error:
                raise ValueError(f"structured_outputs.{spec.field}: {error}")
            self._grammars[key] = grammar
        return grammar

    def matcher(self, spec: StructuredOutputsParams) -> GrammarMatcher:
        return GrammarMatcher(
            self._llguidance.LLMatcher(self.tokenizer, self.grammar(spec), log_level=0), self.vocab_size
        )


@dataclass(slots=True)
class GrammarMatcher:
    """One sequence's position in its grammar."""

    matcher: object  # llguidance.LLMatcher
    vocab_size: int
    consumed: int = 0  # output tokens fed to the matcher so far

    def sync(self, output: list[int]) -> None:
        for token in output[self.consumed :]:
            self.matcher.consume_token(token)
        self.consumed = len(output)
        if self.matcher.is_error():
            raise RuntimeError(f"structured output: the grammar refused a token: {self.matcher.get_error()}")

    def allowed(self) -> np.ndarray:
        """[V] bool: the tokens the grammar allows next."""
        words = np.empty((self.vocab_size + 31) // 32, dtype=np.int32)
        self.matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        return np.unpackbits(words.view(np.uint8), bitorder="little")[: self.vocab_size].astype(bool)


def apply_grammar_masks(logits: torch.Tensor, rows: list[int], masks: list[np.ndarray]) -> None:
    """In place: -inf where a row's grammar forbids the token."""
    if rows:
        forbidden = ~torch.from_numpy(np.stack(masks)).to(logits.device)
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits[index].masked_fill(forbidden, float("-inf"))
