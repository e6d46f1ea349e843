"""Hugging Face folders: config.json → ModelConfig, safetensors (sharded or not) → named weights.

Gemma's RMSNorms multiply by (1 + w) and its checkpoints store w: the weights come out as 1 + w, the form the
model's RMSNorm (and llama.cpp's GGUF converter) uses."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from tokenloop.models.config import ModelConfig


def config_from_folder(folder: Path) -> ModelConfig:
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{str(folder)!r} has no config.json; expected a Hugging Face model folder or a .gguf file")
    return ModelConfig.from_hf_config(json.loads(config_file.read_text()))


# Architectures whose checkpoints store RMSNorm weights as w for a (1 + w) scale.
ONE_CENTERED_NORMS = {"Gemma3ForCausalLM"}


def iter_safetensors_weights(folder: Path, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    one_centered = config.architecture in ONE_CENTERED_NORMS
    for name, tensor in _iter_tensors(folder):
        # In float32, as transformers computes 1 + w, whatever the checkpoint's dtype.
        yield name, (1.0 + tensor.float() if one_centered and name.endswith("norm.weight") else tensor)


def _iter_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{str(folder)!r} has no .safetensors weights")
    for name in files:
        with safe_open(folder / name, framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)
