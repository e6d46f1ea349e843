"""Session-wide fixtures: the default model (pulled into the model store once) and its transformers reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    from tokenloop.models.store import resolve

    return resolve(None)


@pytest.fixture(scope="session")
def llm_fp32(default_model_path):
    """tokenloop on the default GGUF, exact float32 path, on the CPU like the reference."""
    from tokenloop import LLM

    return LLM(default_model_path, dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def hf_reference(default_model_path):
    """transformers loading the same GGUF (dequantized to float32): the model and its tokenizer."""
    transformers = pytest.importorskip("transformers")
    folder, name = str(default_model_path.parent), default_model_path.name
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model, tokenizer
