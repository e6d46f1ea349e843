"""Training data: each JSONL shape's exact token ids and targets, bad lines refused by line number before training,
and packing that never lets an example see or predict across its neighbour."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import write_tiny_tokenizer
from tokenloop.tokenizer.tokenizer import Tokenizer
from tokenloop.train.data import Example, load_examples
from tokenloop.train.packing import (
    IGNORE_INDEX,
    PackedRow,
    batches,
    block_causal_mask,
    example_labels,
    num_scored_tokens,
    pack,
)

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello world!"},
    {"role": "user", "content": "Count to three."},
    {"role": "assistant", "content": "1, 2, 3. Done 😀"},
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Tokenizer:
    """Adds BOS <s>; EOS </s> ends each turn of its template."""
    return Tokenizer.from_hf_folder(write_tiny_tokenizer(tmp_path_factory.mktemp("tiny_tok")))


def gguf_tokenizer(path: Path) -> Tokenizer:
    from tokenloop.models.gguf_metadata import open_gguf, read_metadata

    return Tokenizer.from_gguf_metadata(read_metadata(open_gguf(path)))


@pytest.fixture(scope="module")
def smollm(default_model_path) -> Tokenizer:
    return gguf_tokenizer(default_model_path)


@pytest.fixture(scope="module")
def gemma3(gemma3_path) -> Tokenizer:
    return gguf_tokenizer(gemma3_path)


def write(tmp_path: Path, *lines: str | dict | bytes) -> Path:
    path = tmp_path / "data.jsonl"
    encoded = [x if isinstance(x, bytes) else (x if isinstance(x, str) else json.dumps(x)).encode() for x in lines]
    path.write_bytes(b"\n".join(encoded) + b"\n")
    return path


def load_one(tmp_path: Path, tokenizer: Tokenizer, record: dict, max_len: int = 4096) -> Example:
    [example] = load_examples(write(tmp_path, record), tokenizer, max_len)
    return example


def scored_spans(example: Example) -> list[list[int]]:
    spans, inside = [], False
    for token, scored in zip(example.token_ids, example.scored):
        if scored and not inside:
            spans.append([])
        if scored:
            spans[-1].append(token)
        inside = scored
    return spans


# --- the three shapes ---


def test_text_is_served_encoding_then_eos_with_every_token_but_the_first_scored(tmp_path, tiny):
    example = load_one(tmp_path, tiny, {"text": "Hello world! The quick brown fox."})
    expected = tiny.encode("Hello world! The quick brown fox.") + [tiny.eos_token_id]
    assert expected[0] == tiny.bos_token_id
    assert example.token_ids == tuple(expected)
    assert example.scored == (False,) + (True,) * (len(expected) - 1)
    assert example.line == 1


def check_prompt_completion(tmp_path: Path, tokenizer: Tokenizer, prompt: str, completion: str) -> Example:
    example = load_one(tmp_path, tokenizer, {"prompt": prompt, "completion": completion})
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=True)  # as serving encodes a prompt
    completion_ids = tokenizer.encode(completion, add_special_tokens=False)
    assert example.token_ids == tuple(prompt_ids + completion_ids + [tokenizer.eos_token_id])
    assert example.scored == (False,) * len(prompt_ids) + (True,) * (len(completion_ids) + 1)
    return example


def test_prompt_completion_is_served_prompt_then_completion_then_eos_scored(tmp_path, tiny):
    example = check_prompt_completion(tmp_path, tiny, "Hello tokenizers,", " hello templates.")
    assert example.token_ids[0] == tiny.bos_token_id


@pytest.mark.real_model
def test_prompt_completion_on_the_default_model(tmp_path, smollm):
    example = check_prompt_completion(tmp_path, smollm, "What is 2+2?", " 4, of course.")
    assert not smollm.add_bos_token and example.token_ids[0] != smollm.bos_token_id


@pytest.mark.real_model
def test_gemma3_prompt_starts_with_bos(tmp_path, gemma3):
    example = check_prompt_completion(tmp_path, gemma3, "What is 2+2?", " 4.")
    assert gemma3.add_bos_token and example.token_ids[0] == gemma3.bos_token_id
    text = load_one(tmp_path, gemma3, {"text": "Plain text."})
    assert text.token_ids[0] == gemma3.bos_token_id and text.token_ids[-1] == gemma3.eos_token_id


def check_messages(tmp_path: Path, tokenizer: Tokenizer, end_of_turn: str) -> None:
    example = load_one(tmp_path, tokenizer, {"messages": CONVERSATION})
    assert example.token_ids == tuple(tokenizer.apply_chat_template(CONVERSATION, False, tokenize=True))
    # The targets are exactly each assistant turn's content and its end-of-turn marker, nothing else.
    decoded = [tokenizer.decode(span) for span in scored_spans(example)]
    assert decoded == [m["content"] + end_of_turn for m in CONVERSATION if m["role"] == "assistant"]


def test_messages_score_exactly_the_assistant_turns(tmp_path, tiny):
    check_messages(tmp_path, tiny, "</s>")


@pytest.mark.real_model
def test_messages_on_the_default_model(tmp_path, smollm):
    check_messages(tmp_path, smollm, "<|im_end|>")


@pytest.mark.real_model
def test_messages_on_gemma3(tmp_path, gemma3):
    check_messages(tmp_path, gemma3, "<end_of_turn>")
    assert load_one(tmp_path, gemma3, {"messages": CONVERSATION}).token_ids[0] == gemma3.bos_token_id


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path, tiny):
    # Earlier assistant turns lose their content once another follows (as reasoning templates drop old thinking).
    tiny.chat_template, saved = (
        "{% for m in messages %}<|{{ m['role'] }}|>"
        "{% if m['role'] != 'assistant' or loop.last %}{{ m['content'] }}{% endif %}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}",
        tiny.chat_template,
    )
    try:
        with pytest.raises(ValueError, match=r"data.jsonl line 1: messages\[1\]: the chat template is not prefix-st"):
            load_examples(write(tmp_path, {"messages": CONVERSATION[1:]}), tiny, 4096)
    finally:
        tiny.chat_template = saved


# --- bad data: a ValueError naming the file and the line ---

GOOD = {"prompt": "Hi", "completion": " there"}
BAD = {
    "not_json": ('{"text": "unterminated', r"not JSON: Unterminated string starting at \(column 10\)"),
    "not_utf8": (b'{"text": "\xff"}', r"not UTF-8 text \(byte 10\)"),
    "not_object": (
        '["text", "hi"]',
        "expected a JSON object with 'text', 'prompt' and 'completion', or 'messages', got a JSON array",
    ),
    "unknown_shape": ({"input": "hi", "output": "yo"}, r"expected 'text', .*; got keys \['input', 'output'\]"),
    "missing_completion": ({"prompt": "hi"}, "missing field 'completion'"),
    "missing_prompt": ({"completion": "hi"}, "missing field 'prompt'"),
    "mixed_shapes": ({"text": "hi", "messages": []}, r"mixes shapes \(messages, text\)"),
    "wrong_type": ({"text": 5}, "field 'text' must be a string, got a JSON number"),
    "null_prompt": ({"prompt": None, "completion": "x"}, "field 'prompt' must be a string, got a JSON null"),
    "empty_text": ({"text": ""}, "field 'text' is empty"),
    "empty_completion": ({"prompt": "hi", "completion": ""}, "field 'completion' is empty"),
    "messages_not_list": ({"messages": "hi"}, "field 'messages' must be a non-empty list"),
    "messages_empty": ({"messages": []}, "field 'messages' must be a non-empty list"),
    "message_without_role": (
        {"messages": [{"content": "hi"}]},
        r"messages\[0\] must be an object with a string 'role'",
    ),
    "no_assistant": ({"messages": [{"role": "user", "content": "hi"}]}, "messages has no assistant turn"),
    "empty_assistant": (
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]},
        r"messages\[1\]: the assistant turn is empty",
    ),
    "content_not_string": (
        {"messages": [{"role": "user", "content": ["hi"]}, {"role": "assistant", "content": "yo"}]},
        r"messages\[0\]\['content'\] must be a string",
    ),
    "longer_than_context": ({"text": "hello " * 40}, "4[0-9] tokens, more than the model's context of 32"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_line_is_refused_naming_file_and_line(tmp_path, tiny, case):
    line, message = BAD[case]
    # The bad line is line 3 (after a good line and a blank one), and a good line follows: nothing is returned.
    path = write(tmp_path, GOOD, "", line, GOOD)
    with pytest.raises(ValueError, match=f"^{path} line 3: {message}"):
        load_examples(path, tiny, max_len=32)


@pytest.mark.parametrize("content", [b"", b"\n  \n\n"])
def test_blank_file_is_refused(tmp_path, tiny, content):
    path = tmp_path / "data.jsonl"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=f"^{path}: no examples"):
        load_examples(path, tiny, max_len=32)


def test_an_example_of_exactly_the_context_is_kept(tmp_path, tiny):
    example = load_one(tmp_path, tiny, {"text": "Hello world!"})
    n = len(example.token_ids)
    assert load_one(tmp_path, tiny, {"text": "Hello world!"}, max_len=n) == example
    with pytest.raises(ValueError, match=f"line 1: {n} tokens, more than the model's context of {n - 1}"):
        load_one(tmp_path, tiny, {"text": "Hello world!"}, max_len=n - 1)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(token_ids=(5,), scored=(False,), line=1), "token_ids must hold at least 2"),
        (dict(token_ids=(5, 6), scored=(False,), line=1), "scored must be as long as token_ids"),
        (dict(token_ids=(5, 6), scored=(True, True), line=1), r"scored\[0\] must be False"),
        (dict(token_ids=(5, 6), scored=(False, False), line=1), "scored must mark at least one token"),
        (dict(token_ids=(5, 6), scored=(False, True), line=0), "line must be >= 1"),
    ],
)
def test_example_validates_its_fields(fields, message):
    with pytest.raises(ValueError, match=message):
        Example(**fields)


# --- packing ---


def make(line: int, token_ids: list[int], scored: list[bool]) -> Example:
    return Example(tuple(token_ids), tuple(scored), line)


EXAMPLES = [
    make(1, [10, 11, 12, 13], [False, False, True, True]),
    make(2, [20, 21, 22], [False, True, True]),
    make(3, [30, 31, 32, 33, 34], [False, True, False, True, True]),
    make(4, [40, 41], [False, True]),
]


def test_pack_is_greedy_in_order_with_positions_restarting_and_labels_within_examples():
    rows = pack(EXAMPLES, row_len=8)
    assert [row.seq_lens for row in rows] == [(4, 3), (5, 2)]
    assert [row.lines for row in rows] == [(1, 2), (3, 4)]
    assert rows[0] == PackedRow(
        token_ids=(10, 11, 12, 13, 20, 21, 22),
        labels=(IGNORE_INDEX, 12, 13, IGNORE_INDEX, 21, 22, IGNORE_INDEX),
        positions=(0, 1, 2, 3, 0, 1, 2),
        seq_lens=(4, 3),
        lines=(1, 2),
    )
    assert rows[1].labels == (31, IGNORE_INDEX, 33, 34, IGNORE_INDEX, 41, IGNORE_INDEX)
    assert rows[1].positions == (0, 1, 2, 3, 4, 0, 1)
    assert [row.num_scored for row in rows] == [4, 4]
    assert num_scored_tokens(rows) == sum(e.num_scored for e in EXAMPLES) == 8


def test_labels_never_cross_an_example_boundary(tmp_path, tiny):
    examples = load_examples(
        write(tmp_path, {"text": "Hello world!"}, GOOD, {"messages": CONVERSATION}, {"text": "fox"}), tiny, 4096
    )
    for row in pack(examples, row_len=256):
        start = 0
        for length in row.seq_lens:
            labels, ids = row.labels[start : start + length], row.token_ids[start : start + length]
            assert labels[-1] == IGNORE_INDEX  # the last token of an example predicts nothing
            assert all(label in (IGNORE_INDEX, ids[i + 1]) for i, label in enumerate(labels[:-1]))
            assert row.positions[start : start + length] == tuple(range(length))
            start += length
    assert num_scored_tokens(pack(examples, 256)) == sum(e.num_scored for e in examples)
    assert [example_labels(e).count(IGNORE_INDEX) for e in examples] == [e.scored.count(False) for e in examples]


def test_pack_refuses_an_example_longer_than_a_row():
    with pytest.raises(ValueError, match="line 3: 5 tokens, more than a row of 4"):
        pack(EXAMPLES, row_len=4)


def test_block_causal_mask_is_causal_within_examples_and_blind_across_them():
    mask = block_causal_mask([2, 3])
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 1, 1, 0],
            [0, 0, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert mask.dtype == torch.bool and torch.equal(mask, expected)
    row = pack(EXAMPLES, row_len=16)[0]
    mask = block_causal_mask(row.seq_lens)
    example = torch.repeat_interleave(torch.arange(len(row.seq_lens)), torch.tensor(row.seq_lens))
    assert not mask[example[:, None] != example[None, :]].any()
    assert torch.equal(mask, torch.ones_like(mask).tril() & (example[:, None] == example[None, :]))


def test_batches_are_a_deterministic_shuffle_of_seed_and_epoch():
    rows = pack([make(i, [i, i + 1], [False, True]) for i in range(1, 11)], row_len=2)
    epoch0 = batches(rows, batch_size=4, seed=7, epoch=0)
    assert [len(b) for b in epoch0] == [4, 4, 2]  # the last batch is short
    assert sorted(r.lines for b in epoch0 for r in b) == sorted(r.lines for r in rows)  # every row once
    assert batches(rows, 4, seed=7, epoch=0) == epoch0
    assert batches(rows, 4, seed=7, epoch=0)[1:] == epoch0[1:]  # a resumed run skips to its step
    order = [r.lines[0] for b in epoch0 for r in b]
    assert order != list(range(1, 11))
    assert [r.lines[0] for b in batches(rows, 4, seed=7, epoch=1) for r in b] != order
    assert [r.lines[0] for b in batches(rows, 4, seed=8, epoch=0) for r in b] != order
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        batches(rows, 0, seed=7, epoch=0)
