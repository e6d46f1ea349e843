"""Batched LoRA: a decoder linear wrapped so that the base product runs once for the whole batch and each row's
adapter adds its low-rank delta x A^T B^T (rows grouped by adapter; rows of no adapter add nothing).

Which rows use which adapter is the step's LoRABatch, set by the model runner on the LoRAContext its wrapped
linears share, for the span of one forward pass (LoRAContext.use).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from tokenloop.models.layers import gated
from tokenloop.models.lora import TARGETS
from tokenloop.models.quant import dense_linear


@dataclass(slots=True)
class LoRABatch:
    """Per adapter slot in the step: the flat rows (tokens) that use it, [n] int64 on the model's device."""

    groups: list[tuple[int, torch.Tensor]]


@dataclass(slots=True)
class LoRAContext:
    """The current step's LoRABatch (None: every row is the base model's), shared by the wrapped linears."""

    batch: LoRABatch | None = None

    @contextmanager
    def use(self, batch: LoRABatch | None) -> Iterator[None]:
        previous, self.batch = self.batch, batch
        try:
            yield
        finally:
            self.batch = previous


class LoRALinear(nn.Module):
    """base(x), plus for the rows of each adapter x A^T B^T (B scaled). The products go through dense_linear:
    each row gets the same floats whatever rows are beside it, so batching never changes a token."""

    def __init__(self, base: nn.Module, context: LoRAContext) -> None:
        super().__init__()
        self.base = base
        self.context = context
        self.adapters: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # slot → (A [r, in], B [out, r])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._add_deltas(self.base(x), x)

    @property
    def cpu_kernel(self) -> bool:
        """Whether the base is a quantized linear whose kernel takes a gated MLP's [gate | up] whole."""
        return getattr(self.base, "cpu_kernel", False)

    def gated_forward(self, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
        """A down projection of act(gate) * up: the base's fused kernel for every row, the input formed only for
        the adapters' rows."""
        return self._add_deltas(self.base.gated_forward(gate_up, activation), gate_up, activation)

    def _add_deltas(self, y: torch.Tensor, x: torch.Tensor, activation: str | None = None) -> torch.Tensor:
        """y (T, out) plus each adapter's rows' x A^T B^T (x: the input, or [gate | up] with an activation)."""
        batch = self.context.batch
        if batch is None:
            return y
        for slot, rows in batch.groups:
            if (ab := self.adapters.get(slot)) is not None:
                a, b = ab
                x_rows = x.index_select(0, rows)
                if activation is not None:
                    x_rows = gated(x_rows, activation)
                y.index_add_(0, rows, dense_linear(dense_linear(x_rows, a), b))
        return y

    def extra_repr(self) -> str:
        return f"adapters={len(self.adapters)}"


def wrap_lora_targets(model: nn.Module, context: LoRAContext) -> dict[str, LoRALinear]:
    """Wrap every decoder linear an adapter may target (models/lora.py TARGETS) in a LoRALinear sharing `context`;
    returns them by module name (as adapters name them, e.g. "layers.0.self_attn.qkv_proj")."""
    wrapped = {}
    for name, module in list(model.named_modules()):
        parent_name, _, child = name.rpartition(".")
        if child in TARGETS and name.startswith("layers.") and not isinstance(module, LoRALinear):
            wrapped[name] = LoRALinear(module, context)
            setattr(model.get_submodule(parent_name), child, wrapped[name])
    return wrapped
