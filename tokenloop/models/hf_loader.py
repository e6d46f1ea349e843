"""Hugging Face folders: config.json → ModelConfig, safetensors (sharded or not) → named weights."""

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


def iter_safetensors_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
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
