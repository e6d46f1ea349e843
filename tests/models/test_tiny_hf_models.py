"""Tiny random Llama, Mistral and Qwen2 checkpoints written by transformers load and give transformers' logits."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import forward_in_chunks
from tokenloop.models.loader import load_model

transformers = pytest.importorskip("transformers")

TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**TINY, tie_word_embeddings=False),
    "llama3-rope-tied": lambda: transformers.LlamaConfig(
        **TINY,
        tie_word_embeddings=True,
        rope_scaling=LLAMA3_ROPE_SCALING,
    ),
    "mistral-sliding-window": lambda: transformers.MistralConfig(**TINY, sliding_window=8),
    "qwen2-bias": lambda: transformers.Qwen2Config(**TINY, tie_word_embeddings=True),
    "llama-sharded": lambda: transformers.LlamaConfig(**TINY, tie_word_embeddings=False),
}


@pytest.fixture(params=sorted(CONFIGS), scope="module")
def checkpoint(request, tmp_path_factory):
    torch.manual_seed(0)
    config = CONFIGS[request.param]()
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval()
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder, max_shard_size="40KB" if request.param.endswith("sharded") else "5GB")
    assert (folder / "model.safetensors.index.json").is_file() == request.param.endswith("sharded")
    return model, folder


def test_logits_match_transformers(checkpoint):
    hf_model, folder = checkpoint
    loaded = load_model(folder, torch.float32, torch.device("cpu"), load_tokenizer=False)
    token_ids = torch.randint(0, TINY["vocab_size"], (24,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        expected = hf_model(torch.tensor([token_ids])).logits[0]
    # One parallel pass, and the same sequence fed in uneven chunks then token by token.
    torch.testing.assert_close(forward_in_chunks(loaded, token_ids, [24]), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(forward_in_chunks(loaded, token_ids, [5, 7] + [1] * 12), expected, atol=1e-4, rtol=0)
