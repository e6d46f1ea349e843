"""Streaming detokenization: deltas add up to the full decode, never show a broken character or a stop string."""

from __future__ import annotations

import pytest

from tokenloop.tokenizer.detokenizer import IncrementalDetokenizer
from tokenloop.tokenizer.tokenizer import Tokenizer

MIXED = " Hello 世界! 😀👍🏽 naïve  spaces\n\n1. 中文，emoji 🇺🇸 end"


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], str | None]:
    """Feed ids one at a time as an engine would; returns the deltas and the stop string hit, if any."""
    deltas = []
    for i in ids:
        hit = detok.update([i])
        deltas.append(detok.stream_delta(finished=hit is not None))
        if hit is not None:
            return deltas, hit
    deltas.append(detok.stream_delta(finished=True))
    return deltas, None


@pytest.mark.real_model
def test_streamed_mixed_text_equals_full_decode(smollm: Tokenizer):
    prompt = smollm.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True)
    ids = smollm.encode(MIXED)
    assert any("\ufffd" in smollm.decode([i]) for i in ids)  # the text does split characters over tokens
    detok = IncrementalDetokenizer(smollm, prompt, stop=[])
    deltas, hit = stream(detok, ids)
    assert hit is None
    assert "".join(deltas) == detok.output_text == smollm.decode(ids) == MIXED
    assert not any("\ufffd" in d for d in deltas)
    assert next(d for d in deltas if d) == " Hello"  # the leading space of the first token survives


@pytest.mark.real_model
def test_stop_string_split_over_tokens_is_found_and_never_streamed(smollm: Tokenizer):
    text = "The answer is forty-two, surely."
    ids = smollm.encode(text)
    stop = "swer is fo"  # starts inside " answer" and ends inside a later token
    assert not any(stop in smollm.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(smollm, [], stop=["never", stop])
    deltas, hit = stream(detok, ids)
    assert hit == stop
    assert detok.output_text == "The an"
    assert "".join(deltas) == "The an"


@pytest.mark.real_model
def test_stop_string_inside_a_multibyte_character_run(smollm: Tokenizer):
    text = "好的😀👍🏽谢谢"
    detok = IncrementalDetokenizer(smollm, [], stop=["👍🏽谢"])
    deltas, hit = stream(detok, smollm.encode(text))
    assert hit == "👍🏽谢"
    assert "".join(deltas) == detok.output_text == "好的😀"
    assert not any("\ufffd" in d for d in deltas)


def test_deltas_hold_back_what_could_start_a_stop_string(tiny: Tokenizer):
    detok = IncrementalDetokenizer(tiny, [], stop=["STOP!", "x"])
    assert detok.update(tiny.encode("Hello world", add_special_tokens=False)) is None
    assert detok.stream_delta(finished=False) == "Hello w"  # longest stop is 5 chars: 4 wait
    assert detok.stream_delta(finished=False) == ""
    assert detok.stream_delta(finished=True) == "orld"


def test_earliest_stop_wins_when_several_tokens_arrive_at_once(tiny: Tokenizer):
    detok = IncrementalDetokenizer(tiny, tiny.encode("prompt"), stop=["lazy", "quick"])
    ids = tiny.encode("The quick brown fox jumps over the lazy dog.", add_special_tokens=False)
    assert detok.update(ids) == "quick"
    assert detok.output_text == "The "
    assert detok.stream_delta(finished=True) == "The "


def test_special_tokens_are_skipped_unless_asked(tiny: Tokenizer):
    ids = tiny.encode("<|assistant|>Hello</s>", add_special_tokens=False)
    assert "".join(stream(IncrementalDetokenizer(tiny, [], stop=[]), ids)[0]) == "Hello"
    kept = IncrementalDetokenizer(tiny, [], stop=[], skip_special_tokens=False)
    assert "".join(stream(kept, ids)[0]) == "<|assistant|>Hello</s>"
