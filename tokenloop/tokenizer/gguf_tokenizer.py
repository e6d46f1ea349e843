"""Rebuild a Hugging Face `tokenizers.Tokenizer` from the vocabulary a GGUF file carries.

Covers `tokenizer.ggml.model` 'gpt2' (byte-level BPE, split the way `tokenizer.ggml.pre` names) and
'llama' (SentencePiece-style BPE with byte fallback), matching what llama.cpp does with the same file.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

# llama.cpp token types (gguf.TokenType)
UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_FAMILIES = {
    "gpt2": ("default", "gpt-2"),
    # SmolLM/StarCoder: each digit is its own piece before the GPT-2 regex runs, so " 1" never merges
    # and "\n\n1" keeps "\n\n" whole (llama.cpp: "\p{N}" then the GPT-2 regex; tokenizer.json: Digits then ByteLevel)
    "digits": ("smollm", "starcoder", "refact"),
    "llama3": ("llama-bpe", "llama3", "llama-v3", "dbrx", "smaug-bpe"),
    "qwen2": ("qwen2", "deepseek-r1-qwen"),
}
_PRE_FAMILY = {name: family for family, names in _PRE_FAMILIES.items() for name in names}

# Control tokens that end a turn although the file does not name them eos; llama.cpp stops on them too.
_END_OF_GENERATION_TEXTS = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>"}


def build_gguf_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """The Rust tokenizer for the vocabulary in `meta`, with BOS/EOS added as the file asks."""
    model = meta.get("tokenizer.ggml.model")
    if model == "gpt2":
        tokenizer = _byte_level_bpe(meta)
    elif model == "llama":
        tokenizer = _sentencepiece_bpe(meta)
    else:
        raise ValueError(f"unsupported tokenizer.ggml.model {model!r} (supported: 'gpt2', 'llama')")
    _add_special_tokens(tokenizer, meta)
    _set_post_processor(tokenizer, meta)
    return tokenizer


def gguf_end_of_generation_ids(meta: dict[str, Any]) -> list[int]:
    """eos first, then eot/eom and control tokens that by name end a turn."""
    ids = [meta.get(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
    types = meta.get("tokenizer.ggml.token_type") or []
    for i, (text, token_type) in enumerate(zip(meta["tokenizer.ggml.tokens"], types)):
        if token_type == CONTROL and text in _END_OF_GENERATION_TEXTS:
            ids.append(i)
    return list(dict.fromkeys(i for i in ids if i is not None))


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)  # a spelling listed twice keeps its first id
    return vocab


def _byte_level_bpe(meta: dict[str, Any]) -> Tokenizer:
    pre = meta.get("tokenizer.ggml.pre", "default")
    family = _PRE_FAMILY.get(pre)
    if family is None:
        raise ValueError(f"unsupported tokenizer.ggml.pre {pre!r} (supported: {', '.join(sorted(_PRE_FAMILY))})")
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(BPE(_vocab(meta["tokenizer.ggml.tokens"]), merges, ignore_merges=family == "llama3"))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if family == "digits":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif family in ("llama3", "qwen2"):
        split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT if family == "llama3" else _QWEN2_SPLIT), behavior="isolated")
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(meta: dict[str, Any]) -> Tokenizer:
    tokens = meta["tokenizer.ggml.tokens"]
    vocab = _vocab(tokens)
    if "tokenizer.ggml.merges" in meta:
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    else:
        merges = _merges_from_scores(tokens, meta["tokenizer.ggml.scores"], vocab)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    tokenizer = Tokenizer(BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    # Prepend runs on every stretch of text between added tokens: llama.cpp also adds the space
    # at the start and after each special token.
    steps = [normalizers.Prepend("▁")] if add_space_prefix else []
    tokenizer.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if add_space_prefix else steps)
    return tokenizer


def _merges_from_scores(tokens: list[str], scores: list[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Old SentencePiece files list no merges: every split of a token into two known tokens is a merge,
    ranked by the merged token's score (best first), as transformers' `generate_merges` ranks them."""
    merges = []
    for token, score in zip(tokens, scores):
        pairs = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        pairs.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        merges.extend((left, right, score) for left, right in pairs)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _add_special_tokens(tokenizer: Tokenizer, meta: dict[str, Any]) -> None:
    """Control and user-defined tokens are matched whole in the text before any splitting, as in llama.cpp;
    their ids already exist in the vocabulary, so nothing new is appended."""
    tokens, types = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type") or []
    special = [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types) if k in (UNKNOWN, CONTROL)]
    user = [AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types) if k == USER_DEFINED]
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(user)


def _add_bos_token(meta: dict[str, Any]) -> bool:
    """llama.cpp's default when the file has no flag: SentencePiece and Llama-3 vocabularies start with BOS."""
    default = meta.get("tokenizer.ggml.model") == "llama" or _PRE_FAMILY.get(meta.get("tokenizer.ggml.pre")) == "llama3"
    return bool(meta.get("tokenizer.ggml.add_bos_token", default))


def _set_post_processor(tokenizer: Tokenizer, meta: dict[str, Any]) -> None:
    tokens = meta["tokenizer.ggml.tokens"]
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    start = [bos] if _add_bos_token(meta) and bos is not None else []
    end = [eos] if meta.get("tokenizer.ggml.add_eos_token", False) and eos is not None else []
    if start or end:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=[*(tokens[i] for i in start), "$A", *(tokens[i] for i in end)],
            special_tokens=[(tokens[i], i) for i in dict.fromkeys(start + end)],
        )
