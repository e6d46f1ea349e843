"""GGUF checkpoints: metadata → ModelConfig, tensors → Hugging Face-named weights (dequantized one at a time)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import gguf
import numpy as np
import torch
from gguf.quants import dequantize

from tokenloop.models.config import ModelConfig
from tokenloop.models.ggml_types import GGML_FORMATS
from tokenloop.models.quant import Int4Tensor, Int8Tensor, QuantLayout

# GGUF's general.architecture → Hugging Face class name. Mistral GGUFs declare "llama".
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}

T = gguf.GGMLQuantizationType
SUPPORTED_TENSOR_TYPES = {T.F32, T.F16, T.BF16, T.Q8_0, T.Q5_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_K, T.Q6_K}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# Gemma 3 normalises before and after attention and the MLP: its ffn_norm is the MLP's pre-norm.
_ARCH_BLOCK_NAMES = {
    "Gemma3ForCausalLM": _BLOCK_NAMES
    | {
        "ffn_norm": "pre_feedforward_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
# Gemma 3's local:global layer pattern and local RoPE base are not in its GGUF metadata: llama.cpp hard-codes
# them as transformers' Gemma3TextConfig defaults them.
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_LOCAL_ROPE_THETA = 10000.0
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def config_from_gguf(meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}")

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}")
        return value

    num_heads = get("attention.head_count")
    hidden = get("embedding_length")
    head_dim = get("attention.key_length", hidden // num_heads)
    rope_scaling = None
    scaling_type = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": get("rope.scaling.factor")}
    elif scaling_type not in ("none", None):
        raise ValueError(f"unsupported GGUF rope scaling {scaling_type!r}")
    if "rope_freqs.weight" in tensor_names:
        raise ValueError("unsupported GGUF tensor rope_freqs.weight (llama3 rope scaling stored as a tensor)")
    extra = _gemma3_config(get("block_count"), hidden, num_heads, head_dim) if arch == "gemma3" else {}
    return ModelConfig(
        architecture=GGUF_ARCHITECTURES[arch],
        vocab_size=meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"]),
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_layers=get("block_count"),
        num_heads=num_heads,
        num_kv_heads=get("attention.head_count_kv", num_heads),
        head_dim=head_dim,
        rms_norm_eps=get("attention.layer_norm_rms_epsilon"),
        rope_theta=get("rope.freq_base", 10000.0),
        max_position_embeddings=get("context_length"),
        rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        sliding_window=meta.get(f"{arch}.attention.sliding_window"),
        **extra,
    )


def _gemma3_config(num_layers: int, hidden: int, num_heads: int, head_dim: int) -> dict[str, Any]:
    """What Gemma 3's architecture fixes beyond the shared metadata, as llama.cpp reads the same file."""
    pattern = GEMMA3_SLIDING_WINDOW_PATTERN
    return dict(
        layer_types=["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)],
        rope_local_theta=GEMMA3_LOCAL_ROPE_THETA,
        hidden_activation="gelu_pytorch_tanh",
        # Scores are scaled by 1/sqrt(head_dim), except in the 27B model (62 layers): 1/sqrt(hidden / heads).
        query_pre_attn_scalar=hidden // num_heads if num_layers == 62 else head_dim,
    )


def hf_name(gguf_name: str, architecture: str = "LlamaForCausalLM") -> str:
    """A GGUF tensor's Hugging Face name in a model of `architecture` (a Hugging Face class name)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    block_names = _ARCH_BLOCK_NAMES.get(architecture, _BLOCK_NAMES)
    m = _BLOCK_TENSOR.fullmatch(gguf_name)
    if m is None or m.group(2) not in block_names:
        raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")
    return f"model.layers.{m.group(1)}.{block_names[m.group(2)]}.{m.group(3)}"


def iter_gguf_weights(
    reader: gguf.GGUFReader, config: ModelConfig, keep_quantized: bool = False
) -> Iterator[tuple[str, torch.Tensor | Int4Tensor | Int8Tensor]]:
    """Yield (Hugging Face name, tensor) one at a time from the memory map: float32, dequantized, except, with
    keep_quantized, the types of GGML_FORMATS as Int4Tensor or Int8Tensor (the file's own integers and scales)."""
    permute_qk = config.architecture == GGUF_ARCHITECTURES["llama"]
    for t in reader.tensors:
        if t.tensor_type not in SUPPORTED_TENSOR_TYPES:
            supported = ", ".join(sorted(q.name for q in SUPPORTED_TENSOR_TYPES))
            raise ValueError(f"tensor {t.name!r} has unsupported type {t.tensor_type.name} (supported: {supported})")
        name = hf_name(t.name, config.architecture)
        rows = slice(None)  # llama's Q/K rows come permuted: index them back into rotate-half order
        if permute_qk and t.name.endswith((".attn_q.weight", ".attn_k.weight")):
            heads = config.num_heads if ".attn_q." in t.name else config.num_kv_heads
            rows = torch.from_numpy(unpermute_rope_rows(np.arange(t.data.shape[0]), heads))
        if keep_quantized and _kept_quantized(t):
            yield name, GGML_FORMATS[t.tensor_type].convert(t.data).rows(rows)
        else:
            yield name, dequantize_rows(t.data, t.tensor_type)[rows]


def dequantize_rows(
    data: np.ndarray, tensor_type: gguf.GGMLQuantizationType, rows_per_chunk: int = 4096
) -> torch.Tensor:
    """gguf's dequantization into one float32 tensor, a block of rows at a time: its temporaries stay the size of
    a block instead of several copies of a large tensor (the embedding) at the peak of loading."""
    if data.ndim < 2 or data.shape[0] <= rows_per_chunk:
        return torch.from_numpy(np.require(dequantize(data, tensor_type), requirements=["C", "W"]))
    first = dequantize(data[:rows_per_chunk], tensor_type)
    out = torch.empty((data.shape[0], *first.shape[1:]), dtype=torch.float32)
    out[:rows_per_chunk] = torch.from_numpy(first)
    for start in range(rows_per_chunk, data.shape[0], rows_per_chunk):
        out[start : start + rows_per_chunk] = torch.from_numpy(
            dequantize(data[start : start + rows_per_chunk], tensor_type)
        )
    return out


def quantized_layouts(reader: gguf.GGUFReader, config: ModelConfig) -> dict[str, QuantLayout]:
    """Hugging Face name → layout of every tensor that iter_gguf_weights(keep_quantized=True) yields quantized."""
    return {
        hf_name(t.name, config.architecture): GGML_FORMATS[t.tensor_type].layout
        for t in reader.tensors
        if _kept_quantized(t)
    }


def _kept_quantized(t: gguf.ReaderTensor) -> bool:
    """Whether the fast path keeps this tensor in its file's integers: a matrix of a type in GGML_FORMATS."""
    return t.tensor_type in GGML_FORMATS and t.data.ndim == 2


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs) back to rotate-half order."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
