"""The tokenizer the engine talks to: text <-> token ids, special tokens, and the chat template.

Built from a GGUF file's metadata or from a Hugging Face folder; either way a Rust `tokenizers.Tokenizer` does the work.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tokenizers

from tokenloop.tokenizer.builtin_templates import gguf_chat_template
from tokenloop.tokenizer.chat_template import render_chat_template
from tokenloop.tokenizer.gguf_tokenizer import build_gguf_tokenizer, gguf_end_of_generation_ids

# One text at a time gains nothing from the Rust pool, and a process that forks after using it warns on stderr.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class TooManyTokens(ValueError):
    def __init__(self, num_tokens: int) -> None:
        super().__init__(f"the text has {num_tokens} tokens")
        self.num_tokens = num_tokens


@dataclass(slots=True)
class Tokenizer:
    """Wraps a `tokenizers.Tokenizer` (Rust) plus the model's special tokens and chat template."""

    backend: tokenizers.Tokenizer = field(repr=False)  # its post-processor adds BOS (and EOS) for add_special_tokens
    vocab_size: int  # ids the tokenizer knows; a model's embedding may have more rows
    bos_token_id: int | None
    eos_token_id: int | None
    chat_template: str | None = field(repr=False)
    eos_token_ids: list[int] = field(default_factory=list)  # every id that ends generation, eos first
    bos_token: str | None = field(init=False)
    eos_token: str | None = field(init=False)
    add_bos_token: bool = field(init=False)  # whether encode(add_special_tokens=True) prepends BOS
    _max_token_bytes: int | None = field(default=None, init=False, repr=False)  # 0: no bound (min_tokens)
    # token_bytes: a vocabulary piece to its bytes, and the added tokens (their text), built on first use
    _piece_bytes: Callable[[str], bytes] | None = field(default=None, init=False, repr=False)
    _added: dict[int, bytes] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.bos_token = None if self.bos_token_id is None else self.backend.id_to_token(self.bos_token_id)
        self.eos_token = None if self.eos_token_id is None else self.backend.id_to_token(self.eos_token_id)
        eos = [self.eos_token_id] if self.eos_token_id is not None else []
        self.eos_token_ids = list(dict.fromkeys(eos + self.eos_token_ids))
        first = self.backend.encode("", add_special_tokens=True).ids[:1]
        self.add_bos_token = self.bos_token_id is not None and first == [self.bos_token_id]

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> Tokenizer:
        """meta: GGUF key -> Python value, as `tokenloop.models.gguf_metadata.read_metadata` returns it."""
        return cls(
            backend=build_gguf_tokenizer(meta),
            vocab_size=len(meta["tokenizer.ggml.tokens"]),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
            chat_template=gguf_chat_template(meta),
            eos_token_ids=gguf_end_of_generation_ids(meta),
        )

    @classmethod
    def from_hf_folder(cls, path: str | Path) -> Tokenizer:
        """tokenizer.json and tokenizer_config.json, plus generation_config.json and chat_template.jinja if present."""
        path = Path(path)
        backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        generation = _read_json(path / "generation_config.json")
        extra_eos = generation.get("eos_token_id")  # an id or a list of ids
        bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        return cls(
            backend=backend,
            vocab_size=backend.get_vocab_size(with_added_tokens=True),
            bos_token_id=None if bos is None else backend.token_to_id(bos),
            eos_token_id=None if eos is None else backend.token_to_id(eos),
            chat_template=_hf_chat_template(path, config),
            eos_token_ids=[] if extra_eos is None else extra_eos if isinstance(extra_eos, list) else [extra_eos],
        )

    def encode(self, text: str, add_special_tokens: bool = True, limit: int | None = None) -> list[int]:
        """Special and added tokens written in the text (e.g. "<|im_start|>") become their own ids.

        Tokenizing runs without the GIL (the batch call releases it; the single one does not), so a long text
        stalls no other thread; with `limit`, a text of more tokens raises TooManyTokens before its ids become
        a Python list (which would hold the GIL again, for a million ints)."""
        encoding = self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0]
        if limit is not None and len(encoding) > limit:
            raise TooManyTokens(len(encoding))
        return encoding.ids

    def min_tokens(self, text: str) -> int:
        """At least how many tokens `text` makes, known without tokenizing it: no token stands for more bytes of
        text than it decodes to (plus one: a decoder may strip a leading space). That holds while the normalizer
        only lengthens text (none, Prepend, or a String replaced by one at least as long in bytes) and no unknown
        token swallows what the vocabulary lacks (none, or bytes to fall back on); else the bound is 0."""
        if self._max_token_bytes is None:
            # the normalizer's and the model's own settings: the whole tokenizer's JSON, vocabulary and merges
            # included, is megabytes of Python objects for these few fields
            normalizer = self.backend.normalizer
            normalizer = None if normalizer is None else json.loads(normalizer.__getstate__())
            steps = [] if normalizer is None else normalizer.get("normalizers", [normalizer])
            lengthens = all(
                step["type"] == "Prepend"
                or (
                    step["type"] == "Replace"
                    and "String" in step["pattern"]
                    and len(step["content"].encode()) >= len(step["pattern"]["String"].encode())
                )
                for step in steps
            )
            model = self.backend.model
            unknown = getattr(model, "unk_token", None) is not None and not getattr(model, "byte_fallback", False)
            size = self.backend.get_vocab_size(with_added_tokens=True)
            longest = max(len(self.backend.decode([i], skip_special_tokens=False).encode()) for i in range(size))
            self._max_token_bytes = longest + 1 if lengthens and not unknown else 0
        return -(-len(text.encode()) // self._max_token_bytes) if self._max_token_bytes else 0

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]:
        """Each token's own bytes (decode([id]) loses a multi-byte character split across tokens): the pieces
        join into the text's bytes. Byte-level vocabularies (GPT-2's byte-to-character map) and SentencePiece ones
        ("▁" for a space, "<0xXX>" byte fallback) are read exactly; an added token is its text."""
        if self._piece_bytes is None:
            self._piece_bytes = _piece_decoder(json.loads(self.backend.to_str()).get("decoder"))
            self._added = {i: t.content.encode() for i, t in self.backend.get_added_tokens_decoder().items()}
        added = self._added
        return [added[i] if i in added else self._piece_bytes(self.backend.id_to_token(i) or "") for i in ids]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [self.backend.id_to_token(i) for i in ids]

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tokenize: bool = False, **kwargs: Any
    ) -> str | list[int]:
        """The prompt for `messages`; as token ids when tokenize, without adding BOS (the template writes its own)."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template; pass a plain prompt instead")
        text = render_chat_template(
            self.chat_template, messages, add_generation_prompt, self.bos_token, self.eos_token, **kwargs
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _byte_level_map() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the character standing for each byte in a byte-level vocabulary."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def _piece_decoder(decoder: dict[str, Any] | None) -> Callable[[str], bytes]:
    """A vocabulary piece to its bytes, by the tokenizer's decoder."""
    steps = [] if decoder is None else decoder.get("decoders", [decoder])
    types = {step["type"] for step in steps}
    if "ByteLevel" in types:
        chars = _byte_level_map()
        return lambda piece: bytes(chars[c] for c in piece if c in chars)
    if "ByteFallback" in types:

        def sentencepiece(piece: str) -> bytes:
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                return bytes([int(piece[3:5], 16)])
            return piece.replace("▁", " ").encode()

        return sentencepiece
    return lambda piece: piece.encode()


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_text(token: str | dict | None) -> str | None:
    # tokenizer_config.json writes a special token either as its text or as a serialized AddedToken
    return token.get("content") if isinstance(token, dict) else token


def _hf_chat_template(path: Path, config: dict[str, Any]) -> str | None:
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        template = {t["name"]: t["template"] for t in template}.get("default")
    return template
