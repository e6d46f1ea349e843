"""Adapters at serving time: a request names one (LoRARequest, as vLLM's), the engine gives it a slot.

LoRAManager wraps the model's targeted linears once (models/lora_layers.py) and loads each adapter into a slot the
first time a request names it; a sequence carries its LoRASlot, whose index the model runner turns into rows and
whose identity enters its blocks' prefix-cache hashes (a base and an adapter request never share K/V).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from tokenloop.models.config import ModelConfig
from tokenloop.models.lora import load_adapter
from tokenloop.models.lora_layers import LoRAContext, wrap_lora_targets


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """An adapter by name and PEFT folder (adapter_config.json, adapter_model.safetensors)."""

    name: str
    path: str

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a LoRARequest needs a name")
        object.__setattr__(self, "path", os.fspath(self.path))

    @classmethod
    def parse(cls, spec: str) -> LoRARequest:
        """'NAME=DIR', as `tokenloop serve --lora` takes it."""
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"an adapter is given as NAME=DIR, got {spec!r}")
        return cls(name, path)


@dataclass(frozen=True, slots=True)
class LoRASlot:
    index: int  # the adapter's place in the wrapped linears
    identity: str  # a digest of its files
    request: LoRARequest


class LoRAManager:
    def __init__(self, model: nn.Module, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.config, self.dtype, self.device = config, dtype, device
        self.context = LoRAContext()
        self.modules = wrap_lora_targets(model, self.context)
        self.slots: dict[str, LoRASlot] = {}

    def slot(self, request: LoRARequest) -> LoRASlot:
        """The adapter's slot, loading it the first time (ValueError for a bad folder, or a name already taken by
        another folder)."""
        if (slot := self.slots.get(request.name)) is not None:
            if slot.request.path != request.path:
                raise ValueError(f"adapter {request.name!r} is loaded from {slot.request.path!r}, not {request.path!r}")
            return slot
        adapter = load_adapter(request.name, request.path, self.config, self.dtype, self.device)
        for name, (a, b) in adapter.weights.items():
            base = self.modules[name].base if name in self.modules else None
            if base is None or (a.shape[1], b.shape[0]) != (base.in_features, base.out_features):
                raise ValueError(f"adapter {request.name!r} does not fit this model: its {name} has A {tuple(a.shape)}")
        index = len(self.slots)
        for name, ab in adapter.weights.items():
            self.modules[name].adapters[index] = ab
        self.slots[request.name] = slot = LoRASlot(index, adapter.identity, request)
        return slot
