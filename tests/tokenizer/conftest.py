"""Tokenizers shared by the tokenizer tests, each built once per session: SmolLM2's from its GGUF
(ours and transformers'), and a tiny Hugging Face folder trained here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from tokenloop.tokenizer.tokenizer import Tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Hello tokenizers, hello templates.",
    "def main():\n    print('hi')\n    return 0\n",
    "Numbers like 12345 and 3.14 are common; so are emoji 😀 and 中文.",
    "I'm sure they'll say it's fine, don't you think?",
]
TINY_SPECIAL = ["<s>", "</s>", "<|user|>", "<|assistant|>"]
TINY_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n"
    "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="session")
def smollm_path() -> Path:
    from tokenloop.models.store import resolve

    return resolve(None)


@pytest.fixture(scope="session")
def smollm_meta(smollm_path):
    from tokenloop.models.gguf_metadata import open_gguf, read_metadata

    return read_metadata(open_gguf(smollm_path))


@pytest.fixture(scope="session")
def smollm(smollm_meta) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(smollm_meta)


@pytest.fixture(scope="session")
def hf_smollm(smollm_path):
    """transformers' own conversion of the same GGUF file (slow: ~15 s)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm_path.parent), gguf_file=smollm_path.name)


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory) -> Path:
    """A byte-level BPE that adds <s> through its post-processor, with a chat template and extra eos ids."""
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=TINY_SPECIAL, initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(CORPUS * 5, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    folder = tmp_path_factory.mktemp("tiny_hf")
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True},  # the older, serialized form
        "chat_template": TINY_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
    return folder


@pytest.fixture(scope="session")
def tiny(tiny_folder) -> Tokenizer:
    return Tokenizer.from_hf_folder(tiny_folder)
