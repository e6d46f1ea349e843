"""A trained model as a GGUF file in its base file's types: metadata and tensor order copied, each weight in the
base's GGML type, its bytes kept where the weight did not change, else quantized again by gguf-py (which has no
K-quant quantizer: those fall back to the types llama.cpp itself falls back to)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf.quants import dequantize, quantize
from torch import nn

from tokenloop.models.config import ModelConfig
from tokenloop.models.gguf_loader import GGUF_ARCHITECTURES, hf_name
from tokenloop.models.gguf_metadata import open_gguf, read_metadata
from tokenloop.tokenizer.builtin_templates import gguf_chat_template
from tokenloop.tokenizer.tokenizer import Tokenizer
from tokenloop.train.export import checkpoint_tensors

Q = gguf.GGMLQuantizationType
# Where gguf-py cannot quantize a type (it has no K-quant quantizer), llama.cpp's own fallback for rows that are not
# a multiple of 256 (llama_tensor_get_type): Q4_K → Q5_0, Q6_K → Q8_0; Q5_K's is Q5_1, which tokenloop does not
# load, so Q8_0.
FALLBACK_TYPES = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q8_0, Q.Q6_K: Q.Q8_0}
FLOAT_TYPES = (Q.F32, Q.F16)  # written as numpy floats, not raw bytes


@dataclass(slots=True)
class GGUFExport:
    """What export_gguf wrote, tensor by tensor (GGUF names)."""

    path: Path
    kept: list[str] = field(default_factory=list)  # equal to the base's weights: its bytes copied
    requantized: list[str] = field(default_factory=list)  # changed, quantized again to the base's type
    fallbacks: dict[str, tuple[str, str]] = field(default_factory=dict)  # changed, in another type: (base, written)


def export_gguf(
    model: nn.Module,
    config: ModelConfig,
    tokenizer: Tokenizer | None,
    base_gguf: str | os.PathLike,
    out: str | os.PathLike,
) -> GGUFExport:
    """A GGUF file with the base file's metadata and tensor order, each tensor in the base's GGML type: its bytes
    where the model's weight equals the base's dequantized one, else quantized again by gguf-py from the float32
    weight (llama's q/k rows permuted back as llama.cpp stores them), in a FALLBACK_TYPES type where gguf-py has no
    quantizer. The tokenizer's chat template is written where it differs from the one the base file gives."""
    base_path, out_path = Path(base_gguf), Path(out)
    if out_path.resolve() == base_path.resolve():
        raise ValueError("export_gguf: out must not be the base file (its tensors are read from the memory map)")
    reader = open_gguf(base_path)
    meta = read_metadata(reader)
    weights = checkpoint_tensors(model, config)
    writer = gguf.GGUFWriter(out_path, meta["general.architecture"])
    _copy_metadata(reader, meta, writer)
    if tokenizer is not None and tokenizer.chat_template not in (None, gguf_chat_template(meta)):
        writer.add_chat_template(tokenizer.chat_template)
    result = GGUFExport(out_path)
    permute_qk = config.architecture == GGUF_ARCHITECTURES["llama"]
    for t in reader.tensors:
        name = hf_name(t.name, config.architecture).removeprefix("model.")
        if name not in weights:
            raise ValueError(f"the base GGUF has {t.name!r} ({name}) and the model does not")
        w = weights.pop(name).numpy()
        if tuple(w.shape) != tuple(reversed(t.shape.tolist())):
            raise ValueError(f"{name} has shape {tuple(w.shape)}, the base's {t.name} {tuple(reversed(t.shape))}")
        if permute_qk and t.name.endswith((".attn_q.weight", ".attn_k.weight")):
            w = permute_rope_rows(w, config.num_heads if ".attn_q." in t.name else config.num_kv_heads)
        if np.array_equal(dequantize(t.data, t.tensor_type), w):
            data, qtype = t.data, t.tensor_type
            result.kept.append(t.name)
        else:
            data, qtype = quantize_as(w, t.tensor_type)
            if qtype == t.tensor_type:
                result.requantized.append(t.name)
            else:
                result.fallbacks[t.name] = (t.tensor_type.name, qtype.name)
        writer.add_tensor(t.name, data, raw_dtype=None if qtype in FLOAT_TYPES else qtype)
    if weights:
        raise ValueError(f"the model has weights the base GGUF lacks: {sorted(weights)[:8]}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return result


def quantize_as(w: np.ndarray, qtype: gguf.GGMLQuantizationType) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    """gguf-py's quantization of float32 `w` to qtype, or to FALLBACK_TYPES[qtype] where gguf-py has none."""
    try:
        return quantize(w, qtype), qtype
    except NotImplementedError:
        if qtype not in FALLBACK_TYPES:
            raise ValueError(f"gguf-py cannot quantize {qtype.name} and no fallback type is set for it") from None
        return quantize(w, FALLBACK_TYPES[qtype]), FALLBACK_TYPES[qtype]


def permute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order (interleaved RoPE pairs) from rotate-half order: gguf_loader.unpermute_rope_rows'
    inverse."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _copy_metadata(reader: gguf.GGUFReader, meta: dict[str, Any], writer: gguf.GGUFWriter) -> None:
    """Every key/value of the base file with its own GGUF types (the writer adds general.architecture itself)."""
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name == "general.alignment":
            writer.add_custom_alignment(meta[name])
            continue
        if len(f.types) > 2:
            raise ValueError(f"the base GGUF's {name!r} is an array of arrays, which export_gguf does not copy")
        writer.add_key_value(name, meta[name], f.types[0], sub_type=f.types[1] if len(f.types) == 2 else None)
