"""Checkpoint tensors (Hugging Face names, as both loaders yield them) → a model's parameters: which tensors pack
into one parameter (q/k/v → qkv_proj, gate/up → gate_up_proj), the quantized modules they become, and the copy
that checks every parameter is written. The model definitions know no checkpoint names beyond their own
parameters'; this is the one place the mapping lives.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tokenloop.models.config import ModelConfig
from tokenloop.models.quant import (
    Int4Linear,
    Int4Tensor,
    Int5Linear,
    Int8Embedding,
    Int8Linear,
    Int8Tensor,
    QuantizedModule,
    QuantLayout,
)

# Checkpoint tensors that pack into one of our parameters: name → (our name, shard index).
PACKED_MODULES = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def shard_sizes(config: ModelConfig, packed_name: str) -> list[int]:
    if packed_name == "qkv_proj":
        return [
            config.num_heads * config.head_dim,
            config.num_kv_heads * config.head_dim,
            config.num_kv_heads * config.head_dim,
        ]
    return [config.intermediate_size, config.intermediate_size]


def num_shards(module: str) -> int:
    """Checkpoint tensors that pack into this module's weight (3 for qkv_proj, 2 for gate_up_proj, else 1)."""
    return sum(packed == module for packed, _ in PACKED_MODULES.values()) or 1


def checkpoint_target(config: ModelConfig, ckpt_name: str) -> tuple[str, int, slice]:
    """A checkpoint tensor's destination: (our parameter name, shard index, rows of that parameter)."""
    name = ckpt_name.removeprefix("model.")
    for ckpt_part, (packed, shard_index) in PACKED_MODULES.items():
        if f".{ckpt_part}." in name:
            sizes = shard_sizes(config, packed)
            start = sum(sizes[:shard_index])
            return name.replace(ckpt_part, packed), shard_index, slice(start, start + sizes[shard_index])
    return name, 0, slice(None)


QUANTIZED_LINEARS = {4: Int4Linear, 5: Int5Linear, 8: Int8Linear}  # the module for a layout's bits


def use_quantized(model: nn.Module, layouts: dict[str, QuantLayout]) -> None:
    """Turn into a quantized linear (QUANTIZED_LINEARS) every decoder linear whose checkpoint tensors (all shards)
    are kept quantized in one layout, or in layouts that one widens to (Q5_0 and Q8_0 shards: int8), and a tied
    5- or 8-bit embedding into an Int8Embedding (the LM head too). A linear whose shards have no common layout
    stays float.

    `layouts`: checkpoint name → QuantLayout. Call on the meta device, before the weights are loaded."""
    config = model.config
    embedding = layouts.get("model.embed_tokens.weight")
    if config.tie_word_embeddings and embedding is not None and embedding.widened().bits == 8:
        model.embed_tokens = Int8Embedding(config.vocab_size, config.hidden_size, embedding.widened())
        model.tie_weights()
    shards: dict[str, list[QuantLayout]] = {}  # decoder linear → the layouts of its checkpoint tensors
    for name, layout in layouts.items():
        target, _, _ = checkpoint_target(config, name)
        if target.startswith("layers.") and target.endswith(".weight"):
            shards.setdefault(target.removesuffix(".weight"), []).append(layout)
    for module_name, kinds in shards.items():
        linear = model.get_submodule(module_name)
        if len(set(kinds)) > 1:
            kinds = [kind.widened() for kind in kinds]
        if len(set(kinds)) == 1 and len(kinds) == num_shards(module_name.split(".")[-1]):
            layout = kinds[0]
            parent, child = module_name.rsplit(".", 1)
            setattr(
                model.get_submodule(parent),
                child,
                QUANTIZED_LINEARS[layout.bits](
                    linear.in_features, linear.out_features, linear.bias is not None, layout
                ),
            )


@torch.no_grad()
def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor | Int4Tensor | Int8Tensor]]) -> None:
    """Copy checkpoint tensors (Hugging Face names) into the model's parameters, packing q/k/v and gate/up.

    Every parameter (every shard of a packed one) must be written: a missing or unexpected tensor raises ValueError.
    """
    config = model.config
    params: dict[str, Any] = dict(model.named_parameters())
    params |= {f"{name}.weight": m for name, m in model.named_modules() if isinstance(m, QuantizedModule)}
    expected = set()
    for name in params:
        expected |= {(name, i) for i in range(num_shards(name.split(".")[-2]))}
    written = set()
    for ckpt_name, tensor in weights:
        if config.tie_word_embeddings and ckpt_name.removeprefix("model.") == "lm_head.weight":
            continue  # some checkpoints store the tied head anyway
        target, shard, rows = checkpoint_target(config, ckpt_name)
        if target not in params:
            raise ValueError(f"unexpected tensor {ckpt_name!r} in the checkpoint")
        dest = params[target]
        dest_shape = dest.weight_shape if isinstance(dest, QuantizedModule) else dest.shape
        rows_shape = (len(range(dest_shape[0])[rows]), *dest_shape[1:])
        if tuple(rows_shape) != tuple(tensor.shape):
            raise ValueError(f"tensor {ckpt_name!r} has shape {tuple(tensor.shape)}, expected {tuple(rows_shape)}")
        if isinstance(dest, QuantizedModule):
            dest.load_rows(rows, tensor)
        else:
            dest[rows].copy_(tensor.dequantize() if isinstance(tensor, (Int4Tensor, Int8Tensor)) else tensor)
        written.add((target, shard))
    if missing := sorted(expected - written):
        raise ValueError(f"checkpoint is missing tensors for: {[name for name, _ in missing[:8]]}")
