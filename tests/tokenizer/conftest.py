"""Tokenizers shared by the tokenizer tests, each built once per session: SmolLM2's from its GGUF
(ours and transformers'), and a tiny Hugging Face folder trained here."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import write_tiny_tokenizer
from tokenloop.tokenizer.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def smollm_path(default_model_path) -> Path:
    return default_model_path


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
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tiny_hf"))


@pytest.fixture(scope="session")
def tiny(tiny_folder) -> Tokenizer:
    return Tokenizer.from_hf_folder(tiny_folder)
