"""Gemma 3 on the exact path: tiny random checkpoints written by transformers, as Hugging Face folders and as GGUF
files, give transformers' logits in one pass and in chunks that cross the sliding window (8 positions, a
100-token sequence); its config reads from either config.json spelling; what it does not support is refused."""

from __future__ import annotations

import json

import pytest
import torch

from tests.gguf_files import Q, write_gguf
from tests.helpers import forward_in_chunks
from tokenloop.models.config import ModelConfig
from tokenloop.models.loader import load_model

transformers = pytest.importorskip("transformers")

TOKENS = torch.randint(0, 400, (100,), generator=torch.Generator().manual_seed(1)).tolist()


def chunks_of(size: int | None) -> list[int]:
    if size is None:
        return [len(TOKENS)]
    return [size] * (len(TOKENS) // size) + ([len(TOKENS) % size] if len(TOKENS) % size else [])


def interleaved_checkpoint(folder):
    """Sliding and global layers alternating (not the 5:1 pattern), an attention scale that is not the head
    size's, and linear RoPE scaling (the global layers' only)."""
    torch.manual_seed(1)
    config = transformers.Gemma3TextConfig(
        vocab_size=400,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=12,
        sliding_window=8,
        max_position_embeddings=256,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    )
    model = transformers.Gemma3ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=["5-to-1-pattern", "interleaved-linear-rope"])
def checkpoint(request, tiny_gemma3_folder, tmp_path_factory):
    if request.param == "5-to-1-pattern":
        folder = tiny_gemma3_folder
    else:
        folder = interleaved_checkpoint(tmp_path_factory.mktemp("gemma3_interleaved"))
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model(torch.tensor([TOKENS])).logits[0]
    return model, folder, expected


@pytest.mark.parametrize("chunk", [None, 1, 7, 64], ids=["one pass", "chunk 1", "chunk 7", "chunk 64"])
def test_logits_match_transformers(checkpoint, chunk):
    _, folder, expected = checkpoint
    loaded = load_model(folder, torch.float32, torch.device("cpu"), load_tokenizer=False)
    torch.testing.assert_close(forward_in_chunks(loaded, TOKENS, chunks_of(chunk)), expected, atol=1e-4, rtol=0)


def test_the_window_and_the_norms_matter(checkpoint):
    """The checks above can fail: a model that ignores the window, or reads Gemma's norm weights as Llama's,
    is far from transformers' logits."""
    _, folder, expected = checkpoint
    config = json.loads((folder / "config.json").read_text())
    loaded = load_model(folder, torch.float32, torch.device("cpu"), load_tokenizer=False)
    for layer in loaded.model.layers:
        layer.input_layernorm.weight.data -= 1.0
    assert (forward_in_chunks(loaded, TOKENS, chunks_of(None)) - expected).abs().max() > 1e-2
    loaded = load_model(folder, torch.float32, torch.device("cpu"), load_tokenizer=False)
    loaded.model.layer_windows = [None] * config["num_hidden_layers"]
    assert (forward_in_chunks(loaded, TOKENS, chunks_of(None)) - expected).abs().max() > 1e-2


def test_gguf_gives_transformers_logits(tiny_gemma3_folder, tmp_path):
    """A gemma3 GGUF as llama.cpp writes one: norms stored as 1 + w, and no layer pattern, local RoPE base or
    attention scale in the metadata (llama.cpp assumes 5:1, 10,000 and the head size, as the model has)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_gemma3_folder, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model(torch.tensor([TOKENS])).logits[0]
    loaded = load_model(
        write_gguf(model, "gemma3", tmp_path / "m.gguf", Q.F32),
        torch.float32,
        torch.device("cpu"),
        load_tokenizer=False,
    )
    for chunk in (None, 7):
        torch.testing.assert_close(forward_in_chunks(loaded, TOKENS, chunks_of(chunk)), expected, atol=1e-4, rtol=0)


def test_gguf_with_an_unsupported_tensor_type_names_it(tiny_gemma3_folder, tmp_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_gemma3_folder, dtype=torch.float32)
    path = write_gguf(model, "gemma3", tmp_path / "m.gguf", Q.Q5_1)
    with pytest.raises(ValueError, match="unsupported type Q5_1"):
        load_model(path, torch.float32, torch.device("cpu"), load_tokenizer=False)


def test_config_reads_from_older_config_json_spellings(tiny_gemma3_folder):
    """transformers 5 writes layer_types and per-layer-type rope_parameters; Gemma 3's own config.json files have
    sliding_window_pattern, rope_local_base_freq and rope_scaling instead."""
    new = json.loads((tiny_gemma3_folder / "config.json").read_text())
    old = {k: v for k, v in new.items() if k not in ("layer_types", "rope_parameters", "_sliding_window_pattern")}
    old |= {
        "sliding_window_pattern": 6,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "rope_scaling": None,
    }
    assert ModelConfig.from_hf_config(old) == ModelConfig.from_hf_config(new)
    config = ModelConfig.from_hf_config(new)
    assert [config.layer_window(i) for i in range(6)] == [8] * 5 + [None]
    assert [config.layer_rope(i) for i in (0, 5)] == [(10_000.0, None), (1_000_000.0, None)]
    assert config.attention_scale == 16**-0.5 and config.hidden_activation == "gelu_pytorch_tanh"


@pytest.mark.parametrize("field", ["final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention"])
def test_what_is_not_supported_is_refused(tiny_gemma3_folder, field):
    config = json.loads((tiny_gemma3_folder / "config.json").read_text())
    with pytest.raises(ValueError, match=f"unsupported {field}"):
        ModelConfig.from_hf_config(config | {field: 30.0 if "softcapping" in field else True})
