"""A tokenizer read from a Hugging Face folder behaves as transformers' AutoTokenizer on the same folder."""

from __future__ import annotations

import shutil

import pytest

from tokenloop.tokenizer.tokenizer import Tokenizer

TEXTS = ["Hello world!", "def main():\n    return 0\n", "unseen wörds 😀 12345", "<|user|>hi</s>", "  spaced  out  "]
MESSAGES = [
    {"role": "system", "content": "Be kind."},
    {"role": "user", "content": "Hello!"},
    {"role": "assistant", "content": "Hello world."},
    {"role": "user", "content": "Again?"},
]


@pytest.fixture(scope="module")
def hf_tiny(tiny_folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_folder))


def test_special_tokens_come_from_the_config_files(tiny: Tokenizer):
    assert (tiny.bos_token, tiny.bos_token_id, tiny.eos_token, tiny.eos_token_id) == ("<s>", 0, "</s>", 1)
    assert tiny.eos_token_ids == [1, 3]  # eos, then generation_config's list
    assert tiny.add_bos_token  # the post-processor adds <s>
    assert tiny.vocab_size == 400


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tiny: Tokenizer, hf_tiny, text: str):
    for special in (True, False):
        assert tiny.encode(text, add_special_tokens=special) == hf_tiny.encode(text, add_special_tokens=special)
    ids = tiny.encode(text, add_special_tokens=False)
    assert tiny.decode(ids) == text == hf_tiny.decode(ids)
    with_bos = tiny.encode(text)
    assert tiny.decode(with_bos, skip_special_tokens=True) == hf_tiny.decode(with_bos, skip_special_tokens=True)
    assert tiny.convert_ids_to_tokens(ids) == hf_tiny.convert_ids_to_tokens(ids)


@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_chat_template_matches_transformers(tiny: Tokenizer, hf_tiny, add_generation_prompt: bool):
    text = tiny.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt)
    assert text == hf_tiny.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert text.startswith("<s>Be kind.\n<|user|>Hello!</s>\n")
    ids = tiny.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=True)
    out = hf_tiny.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=True)
    assert ids == list(out["input_ids"] if hasattr(out, "keys") else out)
    assert ids.count(tiny.bos_token_id) == 1  # the template's <s> only: no second BOS from encoding


def test_chat_template_jinja_file_wins_over_the_config(tiny_folder, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(tiny_folder, folder)
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    tok = Tokenizer.from_hf_folder(folder)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "x!"


def test_missing_chat_template_is_a_clear_error(tiny: Tokenizer):
    bare = Tokenizer(tiny.backend, tiny.vocab_size, tiny.bos_token_id, tiny.eos_token_id, chat_template=None)
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "x"}])
