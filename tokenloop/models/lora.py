"""LoRA adapters in PEFT's layout (adapter_config.json, adapter_model.safetensors) packed onto our modules.

A set of per-shard LoRAs packs exactly into one LoRA of the packed module (q/k/v → qkv_proj, gate/up →
gate_up_proj): A stacks the shards' A (rows), B is block-diagonal (each shard's B in its output rows and its A's
columns). The scaling (lora_alpha / r, or / sqrt(r) with rslora) is folded into B, so a row's delta is
x A^T B^T.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from tokenloop.models.config import ModelConfig
from tokenloop.models.weights import checkpoint_target, num_shards, shard_sizes

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The decoder linears an adapter may target, as our model names them (the last part of the module name).
TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
UNSUPPORTED = ("use_dora", "rank_pattern", "alpha_pattern", "modules_to_save", "fan_in_fan_out")


@dataclass(slots=True)
class LoRAAdapter:
    name: str
    identity: str  # a digest of its files: what its K/V depend on beside the base model and the tokens
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]  # our module name → (A [r, in], B scaled [out, r])


def adapter_identity(folder: Path) -> str:
    digest = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        digest.update(f"{name}:".encode())
        digest.update((folder / name).read_bytes())
    return digest.hexdigest()[:32]


def read_adapter_config(folder: Path) -> tuple[float, dict]:
    """The adapter's scaling (folded into B) and its config; ValueError for what we cannot serve."""
    if not (folder / CONFIG_FILE).is_file() or not (folder / WEIGHTS_FILE).is_file():
        raise ValueError(f"{str(folder)!r} is not a PEFT adapter folder (needs {CONFIG_FILE} and {WEIGHTS_FILE})")
    config = json.loads((folder / CONFIG_FILE).read_text())
    if (kind := config.get("peft_type", "LORA")) != "LORA":
        raise ValueError(f"adapter {str(folder)!r} is {kind}, not LORA")
    if bad := [key for key in UNSUPPORTED if config.get(key)]:
        raise ValueError(f"adapter {str(folder)!r} uses {', '.join(bad)}, which tokenloop does not serve")
    if config.get("bias", "none") != "none":
        raise ValueError(f"adapter {str(folder)!r} trains biases (bias={config['bias']!r}); only 'none' is served")
    r, alpha = config["r"], config.get("lora_alpha", config["r"])
    return alpha / (math.sqrt(r) if config.get("use_rslora") else r), config


def load_adapter(
    name: str, path: str | os.PathLike, config: ModelConfig, dtype: torch.dtype, device: torch.device
) -> LoRAAdapter:
    """Read a PEFT adapter and pack its per-shard LoRAs into our modules' (A, B), in `dtype` on `device`."""
    folder = Path(path)
    scaling, _ = read_adapter_config(folder)
    tensors = load_file(folder / WEIGHTS_FILE)
    # our module → its shards' (rows of the packed output, A [r, in], B [rows, r]), from keys
    # "base_model.model.<checkpoint module>.lora_A.weight"
    parts: dict[tuple[str, slice], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, _, part = key.removeprefix("base_model.model.").rpartition(".lora_")
        if part not in ("A.weight", "B.weight"):
            raise ValueError(f"adapter {name!r}: unexpected tensor {key!r} (only lora_A / lora_B weights are served)")
        target, _, rows = checkpoint_target(config, f"{module}.weight")
        target = target.removesuffix(".weight")
        if not target.startswith("layers.") or target.rpartition(".")[2] not in TARGETS:
            raise ValueError(f"adapter {name!r} targets {module!r}; tokenloop serves LoRA on {', '.join(TARGETS)}")
        parts.setdefault((target, (rows.start, rows.stop)), {})[part[0]] = tensor.float()
    shards: dict[str, list[tuple[tuple, torch.Tensor, torch.Tensor]]] = {}
    for (target, rows), ab in sorted(parts.items(), key=lambda item: (item[0][0], item[0][1][0] or 0)):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"adapter {name!r}: {target} has lora_{next(iter(ab))} without its pair")
        shards.setdefault(target, []).append((rows, ab["A"], ab["B"]))
    weights = {}
    for target, pieces in shards.items():
        packed = target.rpartition(".")[2]
        out = sum(shard_sizes(config, packed)) if num_shards(packed) > 1 else pieces[0][2].shape[0]
        a = torch.cat([piece_a for _, piece_a, _ in pieces])  # [sum of r, in]
        b = torch.zeros(out, a.shape[0])  # [out, sum of r], block-diagonal
        col = 0
        for (start, stop), piece_a, piece_b in pieces:
            rows = slice(start, stop)
            if len(range(out)[rows]) != piece_b.shape[0] or piece_b.shape[1] != piece_a.shape[0]:
                raise ValueError(f"adapter {name!r}: {target}'s lora_B has shape {tuple(piece_b.shape)}")
            b[rows, col : col + piece_a.shape[0]] = piece_b * scaling
            col += piece_a.shape[0]
        weights[target] = (a.to(device, dtype).contiguous(), b.to(device, dtype).contiguous())
    return LoRAAdapter(name, adapter_identity(folder), weights)
