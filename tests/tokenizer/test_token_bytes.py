"""Tokenizer.token_bytes: each token's own bytes, which join into the text's bytes even where a character's bytes
are split across tokens (what the explorer shows of a candidate token). SentencePiece vocabularies: in
test_gguf_vocab_kinds.py, beside their fixture."""

from __future__ import annotations

import pytest

from tests.tokenizer.test_gguf_vocab_kinds import byte_level_gguf, load_both

TEXTS = ["Hello world", "so are emoji 😀 and 中文.", "tabs\tand\nnew lines  twice", "ünïcödé ß 🎉🎉"]


def joined(tokenizer, text: str) -> bytes:
    return b"".join(tokenizer.token_bytes(tokenizer.encode(text, add_special_tokens=False)))


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_pieces_join_into_the_text(tiny, text):
    assert joined(tiny, text) == text.encode()


def test_a_split_character_is_in_no_one_piece_but_in_their_join(tmp_path):
    ours, _ = load_both(byte_level_gguf(tmp_path, "gpt-2"))
    ids = ours.encode("😀", add_special_tokens=False)
    pieces = ours.token_bytes(ids)
    assert len(pieces) > 1 and b"".join(pieces) == "😀".encode()
    assert ours.token_bytes([1]) == [b"<think>"]  # an added token is its text


@pytest.mark.real_model
@pytest.mark.parametrize("text", TEXTS)
def test_smollm2s_pieces_join_into_the_text(smollm, text):
    assert joined(smollm, text) == text.encode()
