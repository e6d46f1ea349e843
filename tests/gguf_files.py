"""Tiny GGUF files written from tiny transformers checkpoints, as llama.cpp's converter writes them: for the loader,
kernel and engine tests that need a real file of a given quantization."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf.quants import quantize

TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
)
GGUF_NAMES = {
    v: k
    for k, v in {
        "token_embd": "embed_tokens",
        "output_norm": "norm",
        "output": "lm_head",
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }.items()
}
# llama.cpp's gemma3 names: four norms per layer, and per-head query and key norms.
GEMMA3_GGUF_NAMES = GGUF_NAMES | {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
Q = gguf.GGMLQuantizationType


def gguf_name(name: str, arch: str = "llama") -> str:
    names = GEMMA3_GGUF_NAMES if arch == "gemma3" else GGUF_NAMES
    parts = name.removeprefix("model.").split(".")
    if parts[0] == "layers":
        return f"blk.{parts[1]}.{names['.'.join(parts[2:-1])]}.{parts[-1]}"
    return f"{names[parts[0]]}.{parts[-1]}"


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert script: rotate-half pairs become interleaved rows."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# K-quant block layouts (256 values each): where the fp16 super-block scales sit, and the block size in bytes.
K_QUANT_SCALES = {Q.Q4_K: ((0, 2), 144), Q.Q5_K: ((0, 2), 176), Q.Q6_K: ((208,), 210)}


def random_k_quant(data: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks with finite, small fp16 scales (gguf-py can dequantize K-quants but not quantize them)."""
    offsets, size = K_QUANT_SCALES[qtype]
    blocks = rng.integers(0, 256, size=(data.shape[0], data.shape[1] // 256, size), dtype=np.uint8)
    for offset in offsets:
        blocks[..., offset : offset + 2] = np.frombuffer(np.float16(0.002).tobytes(), dtype=np.uint8)
    return blocks.reshape(data.shape[0], -1)


def write_gguf(
    model, arch: str, path: Path, qtype: Q, extra_tensor: str | None = None, embedding_qtype: Q | None = None
) -> Path:
    """The model as a GGUF file, every matrix in qtype (the token embedding in embedding_qtype if given)."""
    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    if (
        arch == "gemma3"
    ):  # llama.cpp's converter: the global layers' RoPE base, and Gemma's (1 + w) norms stored as 1 + w
        w.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
        w.add_sliding_window(c.sliding_window)
    else:
        w.add_rope_freq_base(TINY["rope_theta"])
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        data = tensor.float().numpy()
        if arch == "gemma3" and name.endswith("norm.weight"):
            data = data + 1
        tensor_qtype = embedding_qtype if embedding_qtype is not None and name == "model.embed_tokens.weight" else qtype
        if arch == "llama" and ("q_proj.weight" in name or "k_proj.weight" in name):
            data = permute(data, c.num_attention_heads if "q_proj" in name else c.num_key_value_heads)
        if data.ndim == 2 and tensor_qtype in K_QUANT_SCALES:
            w.add_tensor(
                gguf_name(name, arch),
                random_k_quant(data, tensor_qtype, np.random.default_rng(len(name))),
                raw_dtype=tensor_qtype,
            )
        elif data.ndim == 2 and tensor_qtype != Q.F32:
            w.add_tensor(gguf_name(name, arch), quantize(data, tensor_qtype), raw_dtype=tensor_qtype)
        else:
            w.add_tensor(gguf_name(name, arch), data)
    if extra_tensor:
        w.add_tensor(extra_tensor, np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


TOKENS = list(range(3, 90, 4))  # a prompt for the tiny models


# Byte offsets of each block's float16 fields (d, and m or dmin), which must be finite.
HALF_FIELDS = {Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q8_0: [0], Q.Q5_0: [0], Q.Q4_K: [0, 2], Q.Q6_K: [208]}


def random_blocks(qtype: Q, rows: int, cols: int, seed: int, half_range: float = 0.05) -> np.ndarray:
    """Raw rows [rows, bytes per row]: random bytes, the float16 fields uniform in ±half_range."""
    rng = np.random.default_rng(seed)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (rows, cols // block_size, type_size), dtype=np.uint8)
    for at in HALF_FIELDS[qtype]:
        halves = rng.uniform(-half_range, half_range, (rows, cols // block_size)).astype(np.float16)
        halves[0, 0] = 0  # a zero scale too
        data[..., at : at + 2] = halves[..., None].view(np.uint8)
    return data.reshape(rows, -1)
