"""The other GGUF vocabularies (SentencePiece 'llama', byte-level with other pre-tokenizers) on tiny
files written here, against transformers reading the same files; and the errors for unsupported ones."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import models, pre_tokenizers, trainers

from tests.helpers import CORPUS
from tokenloop.models.gguf_metadata import open_gguf, read_metadata
from tokenloop.tokenizer.detokenizer import IncrementalDetokenizer
from tokenloop.tokenizer.tokenizer import Tokenizer

TEXTS = [
    "Hello world! Hello tokenizers.",
    "The quick brown fox jumps over the lazy dog.",
    "def main():\n    print('hi')\n\n\n    return 0\n",
    "Numbers 12345 and 3.14, I'm sure THEY'LL say it's fine",
    "unseen: 中文 😀 naïve\r\n\tend  ",
]
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6


def write_gguf(path: Path, write_vocab) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)  # just enough of a config for transformers to read the file
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    write_vocab(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def load_both(path: Path) -> tuple[Tokenizer, object]:
    from transformers import AutoTokenizer

    ours = Tokenizer.from_gguf_metadata(read_metadata(open_gguf(path)))
    return ours, AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def sentencepiece_pair(tmp_path_factory):
    """A SentencePiece-style vocabulary: <unk> <s> </s>, 256 byte tokens, pieces scored by merge order, no merges."""
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tok = RustTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=450, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(CORPUS * 5, trainer)
    tokens = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * (len(tokens) - len(specials))

    def vocab(w):
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores([-float(i) for i in range(len(tokens))])
        w.add_token_types(types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)

    return load_both(write_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf", vocab))


def byte_level_gguf(folder: Path, pre: str) -> Path:
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=["<|endoftext|>", "<think>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 5, trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]

    def vocab(w):
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_merges(merges)
        w.add_token_types([CONTROL, USER_DEFINED] + [NORMAL] * (len(tokens) - 2))
        w.add_bos_token_id(0)
        w.add_eos_token_id(0)
        w.add_add_bos_token(False)

    return write_gguf(folder / f"{pre}.gguf", vocab)


@pytest.mark.parametrize("text", TEXTS)
def test_sentencepiece_matches_transformers(sentencepiece_pair, text: str):
    ours, hf = sentencepiece_pair
    ids = ours.encode(text)
    assert ids == hf.encode(text)
    assert ids[0] == 1 and ours.add_bos_token
    assert ours.decode(ids, skip_special_tokens=True) == text == hf.decode(ids, skip_special_tokens=True)


def test_sentencepiece_adds_the_space_prefix_after_special_tokens_like_llama_cpp(sentencepiece_pair):
    """llama.cpp prefixes a space to the text at the start and after every special token
    (transformers' non-legacy Metaspace only at the start)."""
    ours, _ = sentencepiece_pair
    pieces = ours.convert_ids_to_tokens(ours.encode("</s>Hello", add_special_tokens=False))
    assert pieces[0] == "</s>" and pieces[1].startswith("▁")
    pieces = ours.convert_ids_to_tokens(ours.encode("  Hello", add_special_tokens=False))
    assert "".join(pieces).startswith("▁▁▁H")  # the prefix space, then the two written


@pytest.mark.parametrize("prompt", ["", "Hello world!"])
def test_sentencepiece_streaming_keeps_word_spaces(sentencepiece_pair, prompt: str):
    """The decoder strips the space SentencePiece puts before the first word; streamed words keep theirs."""
    ours, _ = sentencepiece_pair
    ids = ours.encode("The lazy dog 中文", add_special_tokens=False)
    detok = IncrementalDetokenizer(ours, ours.encode(prompt) if prompt else [], stop=[])
    deltas = []
    for i in ids:
        detok.update([i])
        deltas.append(detok.stream_delta(finished=False))
    deltas.append(detok.stream_delta(finished=True))
    assert "".join(deltas) == ("The lazy dog 中文" if not prompt else " The lazy dog 中文")
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "qwen2"])
def test_byte_level_pre_tokenizers_match_transformers(tmp_path, pre: str):
    ours, hf = load_both(byte_level_gguf(tmp_path, pre))
    for text in TEXTS + ["<think>a</think><|endoftext|>"]:
        ids = ours.encode(text)
        assert ids == hf.encode(text), text
        assert ours.decode(ids) == text
    assert ours.encode("<think><|endoftext|>") == [1, 0]


def bad_meta(**kv) -> dict:
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.merges": [], **kv}


@pytest.mark.parametrize(
    "meta, name",
    [
        (bad_meta(**{"tokenizer.ggml.model": "bert"}), "bert"),
        ({"tokenizer.ggml.tokens": ["a"]}, "None"),
        (bad_meta(**{"tokenizer.ggml.pre": "chameleon"}), "chameleon"),
    ],
)
def test_unsupported_vocabularies_raise_value_error_naming_them(meta: dict, name: str):
    with pytest.raises(ValueError, match=name):
        Tokenizer.from_gguf_metadata(meta)


@pytest.mark.parametrize("text", TEXTS)
def test_sentencepiece_token_bytes_join_into_the_text(sentencepiece_pair, text: str):
    ours, _ = sentencepiece_pair
    pieces = ours.token_bytes(ours.encode(text, add_special_tokens=False))
    assert b"".join(pieces).lstrip(b" ") == text.encode().lstrip(b" ")  # the space prefix is the first piece's "▁"
