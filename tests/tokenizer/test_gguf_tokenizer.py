"""SmolLM2's tokenizer rebuilt from its GGUF file, checked against transformers and llama.cpp."""

from __future__ import annotations

import pytest
import regex

from tokenloop.tokenizer.tokenizer import Tokenizer

pytestmark = pytest.mark.real_model

TEXTS = [
    "Hello, world!",
    "The capital of France is Paris. I'm sure they'll say it's fine, don't you?",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # slow\n",
    "12345 3.14 -7e10 version 2.0.1",
    "我喜欢自然语言处理。日本語のテキスト、한국어 텍스트",
    "emoji 😀👍🏽🇺🇸 ❤️ and ZWJ 👨‍👩‍👧",
    "  multiple   spaces\n\n\n  and\ttabs \r\n trailing  ",
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text<file_sep>more<|im_end|>",
    "Café naïve résumé Ångström",
    "",
    " ",
]
# Where a digit follows whitespace the real model and transformers' GGUF conversion split differently (see below).
DIGITS_AFTER_WHITESPACE = ["Intro:\n\n1. First\n2. Second", "a  1", "x\n 2", "1,000 and 10\n\n20"]

# llama.cpp's pre-tokenizer for tokenizer.ggml.pre == "smollm" (llama-vocab.cpp): first every digit on its
# own, then the GPT-2 regex on each remaining stretch.
LLAMA_CPP_SMOLLM_REGEXES = [
    r"\p{N}",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
]


def llama_cpp_split(text: str, exprs: list[str]) -> list[str]:
    """llama.cpp's unicode_regex_split: each regex cuts every piece into its matches and the gaps between."""
    pieces = [text]
    for expr in exprs:
        out = []
        for piece in pieces:
            pos = 0
            for m in regex.finditer(expr, piece):
                out += [piece[pos : m.start()]] if m.start() > pos else []
                out.append(m.group())
                pos = m.end()
            out += [piece[pos:]] if pos < len(piece) else []
        pieces = out
    return pieces


def test_special_token_attributes(smollm: Tokenizer):
    assert (smollm.bos_token_id, smollm.bos_token) == (1, "<|im_start|>")
    assert (smollm.eos_token_id, smollm.eos_token) == (2, "<|im_end|>")
    assert smollm.eos_token_ids == [2, 0]  # <|endoftext|> also ends generation, as in llama.cpp
    assert smollm.vocab_size == 49152
    assert smollm.add_bos_token is False
    assert smollm.encode("hi", add_special_tokens=True) == smollm.encode("hi", add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_transformers_and_round_trip(smollm: Tokenizer, hf_smollm, text: str):
    ids = smollm.encode(text)
    assert ids == hf_smollm.encode(text)
    assert smollm.decode(ids) == text == hf_smollm.decode(ids)


@pytest.mark.parametrize("text", TEXTS + DIGITS_AFTER_WHITESPACE)
def test_pre_tokenization_matches_llama_cpp_smollm(smollm: Tokenizer, text: str):
    """transformers' GGUF conversion knows no "smollm" pre-tokenizer and falls back to the plain GPT-2
    regex, so "\\n\\n1" becomes [Ċ, Ċ, 1] there but [ĊĊ, 1] in llama.cpp and in SmolLM2's tokenizer.json
    (Digits(individual_digits) then ByteLevel). We follow the real model; DIGITS_AFTER_WHITESPACE is
    where the two differ, so those texts are compared with llama.cpp's regexes instead of transformers."""
    for part in regex.split(r"<\|im_start\|>|<\|im_end\|>|<\|endoftext\|>|<file_sep>", text):
        pieces = smollm.backend.pre_tokenizer.pre_tokenize_str(part)
        assert [part[a:b] for _, (a, b) in pieces] == llama_cpp_split(part, LLAMA_CPP_SMOLLM_REGEXES)
    assert smollm.decode(smollm.encode(text)) == text


@pytest.mark.parametrize(
    "text, ids",
    [  # ids llama.cpp gives for SmolLM2 (smollm pre-tokenizer), the space before digits is a token of its own
        ("Hello world! 123", [19556, 905, 17, 216, 33, 34, 35]),
        ("  multiple   spaces", [216, 2701, 256, 5600]),
        ("Hello, we can use", [19556, 28, 392, 416, 722]),
        ("\n", [198]),
    ],
)
def test_known_llama_cpp_ids(smollm: Tokenizer, text: str, ids: list[int]):
    assert smollm.encode(text) == ids


def test_blank_line_before_a_digit_stays_one_token(smollm: Tokenizer):
    ids = smollm.encode("Intro:\n\n1. First")
    assert smollm.convert_ids_to_tokens(ids) == ["Int", "ro", ":", "ĊĊ", "1", ".", "ĠFirst"]


def test_special_tokens_written_in_text_are_parsed(smollm: Tokenizer):
    ids = smollm.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert smollm.decode(ids, skip_special_tokens=True) == "user\nhi"


@pytest.mark.parametrize(
    "text",
    [
        "All work and no play makes Jack a dull boy. " * 50,
        " " * 300 + "=" * 300,
        "日本語のテキストと絵文字 🎉🎉 " * 20,
        "<|im_start|>user\nhi<|im_end|>" * 10,
        "x",
    ],
)
def test_min_tokens_is_a_lower_bound_of_the_tokens_a_text_makes(smollm, text):
    assert 0 < smollm.min_tokens(text) <= len(smollm.encode(text, add_special_tokens=False))


def test_encode_with_a_limit_refuses_a_longer_text_by_its_count(smollm):
    from tokenloop.tokenizer.tokenizer import TooManyTokens

    text = "All work and no play makes Jack a dull boy. " * 20
    n = len(smollm.encode(text))
    assert smollm.encode(text, limit=n) == smollm.encode(text)
    with pytest.raises(TooManyTokens) as refused:
        smollm.encode(text, limit=n - 1)
    assert refused.value.num_tokens == n
