"""Building blocks shared by the decoder models: RMSNorm, rotary embeddings, the gated MLP (SwiGLU, GeGLU)."""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenloop import kernels
from tokenloop.models.quant import dense_linear


class Linear(nn.Linear):
    """nn.Linear whose product is dense_linear's (tokenloop's float32 kernel on the CPU)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense_linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            x.dtype == self.weight.dtype == torch.float32
            and x.dim() == 2
            and x.device.type == "cpu"
            and kernels.cpu_kernels_available()
        ):
            # One kernel pass per row, in one order whatever the batch (eager and compiled steps alike).
            return torch.ops.tokenloop.rms_norm(x.contiguous(), self.weight, self.eps)
        # Normalise in float32 whatever the activation dtype, as the reference implementations do.
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Per-pair rotation frequencies, [head_dim // 2] float32, with linear or llama3 long-context rescaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None or scaling.get("rope_type", "default") == "default":
        return inv_freq
    if scaling["rope_type"] == "linear":  # positions divided by `factor`
        return inv_freq / scaling["factor"]
    # llama3: low frequencies (long wavelengths) are slowed by `factor`, high ones kept, a smooth ramp between.
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with cos/sin tables precomputed for every position of the context."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        self.register_buffer("cos", torch.empty(max_positions, head_dim), persistent=False)  # (max_positions, head_dim)
        self.register_buffer("sin", torch.empty(max_positions, head_dim), persistent=False)
        if self.cos.device.type != "meta":
            self.reset_tables()

    def reset_tables(self) -> None:
        """Fill cos/sin (after a model built on the meta device is given real memory)."""
        inv_freq = rope_inverse_frequencies(self.head_dim, self.theta, self.scaling).to(self.cos.device)
        positions = torch.arange(self.max_positions, dtype=torch.float32, device=self.cos.device)
        freqs = torch.outer(positions, inv_freq)  # (max_positions, head_dim/2)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos()
        self.sin = emb.sin()

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at the given (T,) positions, (T, 1, head_dim) each: looked up once per forward, used by
        every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate (T, heads, head_dim) by RotaryEmbedding.tables; queries and keys go through together, in one call."""
    cos, sin = cos_sin
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh")}


def gated(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up for gate_up = [gate | up]: the down projection's input."""
    gate, up = gate_up.chunk(2, dim=-1)
    return ACTIVATIONS[activation](gate) * up


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU with silu, GeGLU with Gemma's tanh-approximated GELU."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu") -> None:
        super().__init__()
        self.activation = activation
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)  # gate and up packed in one matmul
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if getattr(self.down_proj, "cpu_kernel", False):  # a QuantizedModule's kernel (under a LoRALinear or not)
            return self.down_proj.gated_forward(gate_up, self.activation)  # the activation inside the product's kernel
        return self.down_proj(gated(gate_up, self.activation))

    def extra_repr(self) -> str:
        return f"activation={self.activation}"
