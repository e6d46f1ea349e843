"""GGUF loading on tiny files written here from tiny transformers models: names, llama.cpp's Q/K permutation,
quantized tensor types, Qwen2 biases, tied embeddings; and clear errors for what is not supported. write_gguf
writes Gemma 3 files too (tests/models/test_gemma3.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.gguf_files import TINY, TOKENS, Q, write_gguf
from tests.helpers import forward_in_chunks
from tokenloop.models.gguf_loader import hf_name
from tokenloop.models.loader import load_model

transformers = pytest.importorskip("transformers")


def our_logits(path: Path) -> torch.Tensor:
    loaded = load_model(path, torch.float32, torch.device("cpu"), load_tokenizer=False)
    return forward_in_chunks(loaded, TOKENS, [len(TOKENS)])


def test_float32_gguf_gives_the_original_models_logits(tiny_model, tmp_path):
    arch, model = tiny_model
    with torch.no_grad():
        expected = model(torch.tensor([TOKENS])).logits[0]
    torch.testing.assert_close(
        our_logits(write_gguf(model, arch, tmp_path / "m.gguf", Q.F32)), expected, atol=1e-4, rtol=0
    )


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q5_0, Q.Q4_0, Q.Q4_1])
def test_quantized_gguf_matches_transformers_on_the_same_file(tiny_model, tmp_path, qtype):
    arch, model = tiny_model
    path = write_gguf(model, arch, tmp_path / "m.gguf", qtype)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32
    )
    with torch.no_grad():
        expected = reference.eval()(torch.tensor([TOKENS])).logits[0]
    torch.testing.assert_close(our_logits(path), expected, atol=1e-4, rtol=0)


def test_unsupported_tensor_type_is_named(tiny_model, tmp_path):
    arch, model = tiny_model
    with pytest.raises(ValueError, match="unsupported type Q5_1"):
        our_logits(write_gguf(model, arch, tmp_path / "m.gguf", Q.Q5_1))


def test_unsupported_tensor_name_is_named(tiny_model, tmp_path):
    arch, model = tiny_model
    with pytest.raises(ValueError, match="blk.0.attn_sinks"):
        our_logits(write_gguf(model, arch, tmp_path / "m.gguf", Q.F32, extra_tensor="blk.0.attn_sinks.weight"))


def test_unsupported_architecture_is_named(tiny_model, tmp_path):
    _, model = tiny_model
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'falcon'"):
        our_logits(write_gguf(model, "falcon", tmp_path / "m.gguf", Q.F32))


def test_truncated_and_corrupt_files_are_clear_errors(tiny_model, tmp_path):
    arch, model = tiny_model
    data = write_gguf(model, arch, tmp_path / "m.gguf", Q.Q8_0).read_bytes()
    (tmp_path / "truncated.gguf").write_bytes(data[: len(data) // 2])
    (tmp_path / "corrupt.gguf").write_bytes(b"GGUF" + bytes(range(256)) * 4)
    for name in ("truncated.gguf", "corrupt.gguf"):
        with pytest.raises(ValueError, match="not a readable GGUF file"):
            load_model(tmp_path / name, torch.float32, torch.device("cpu"), load_tokenizer=False)


def test_gguf_names_map_to_hugging_face_names():
    assert hf_name("blk.3.attn_q.bias") == "model.layers.3.self_attn.q_proj.bias"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("blk.1.ffn_norm.weight") == "model.layers.1.post_attention_layernorm.weight"
    assert hf_name("blk.1.ffn_norm.weight", "Gemma3ForCausalLM") == "model.layers.1.pre_feedforward_layernorm.weight"
    assert (
        hf_name("blk.1.post_attention_norm.weight", "Gemma3ForCausalLM")
        == "model.layers.1.post_attention_layernorm.weight"
    )
    with pytest.raises(ValueError, match="unsupported GGUF tensor"):
        hf_name("blk.0.ffn_gate_exps.weight")


@pytest.fixture(scope="module")
def wide_llama():
    """K-quants pack 256 values per block: every row must be a multiple of 256 long."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        **{**TINY, "hidden_size": 256, "intermediate_size": 512}, tie_word_embeddings=False
    )
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_k_quant_gguf_matches_transformers_on_the_same_file(wide_llama, tmp_path, qtype):
    path = write_gguf(wide_llama, "llama", tmp_path / "m.gguf", qtype)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32
    )
    with torch.no_grad():
        expected = reference.eval()(torch.tensor([TOKENS])).logits[0]
    ours = our_logits(path)
    assert expected.abs().max() > 0.1  # the random blocks give a model that says something
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


def test_loading_a_quantized_model_imports_no_sympy(wide_llama, tmp_path):
    """The skeleton is built on the meta device; a *_like op there would run torch's Python references, which
    import sympy: 32 MB resident for nothing. In a fresh process, on the quantized path (Q4_K: offsets and their
    float16s per 256 weights)."""
    path = write_gguf(wide_llama, "llama", tmp_path / "m.gguf", Q.Q4_K)
    code = (
        "import sys, torch; from tokenloop.models.loader import load_model; "
        f"load_model({str(path)!r}, torch.float32, torch.device('cpu'), keep_quantized=True, load_tokenizer=False); "
        "print('sympy' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
