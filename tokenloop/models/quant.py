"""4-bit weights that stay 4-bit: GGUF Q4_0/Q4_1 blocks mapped exactly onto group-32 int4 with a scale and a zero.

A GGUF Q4_1 group of 32 weights is w = q * d + m (q in 0..15, d and m float16); Q4_0 is w = (q - 8) * d.
Both are w = (q - 8) * scale + zero with scale = d and zero = m + 8d (Q4_1) or 0 (Q4_0): the form that
PyTorch's int4 CPU kernel (`_weight_int4pack_mm_for_cpu`) computes, so the integers need no requantization.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

GROUP_SIZE = 32
# Rows at most for the int4 kernel and for bfloat16 matmuls (decode, batches); more rows (prefill) dequantize
# to float32 for a dense matmul, which has several times their arithmetic throughput on a CPU without
# bfloat16 instructions. Measured on 2 AVX2 cores: the int4 kernel wins up to about 64 rows, bfloat16 up to 16.
INT4_KERNEL_MAX_ROWS = 64
LOW_PRECISION_MAX_ROWS = 16

T = gguf.GGMLQuantizationType
INT4_TENSOR_TYPES = {T.Q4_0, T.Q4_1}


@dataclass(slots=True)
class Int4Tensor:
    """A [N, K] weight as 4-bit integers with one scale and zero per group of 32 along K."""

    q: torch.Tensor  # [N, K] uint8 in 0..15
    scales: torch.Tensor  # [N, K / 32] float32
    zeros: torch.Tensor  # [N, K / 32] float32

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        w = torch.empty(n, k // GROUP_SIZE, GROUP_SIZE, dtype=torch.float32, device=self.q.device)
        return dequantize_into(w, self.q.view(n, k // GROUP_SIZE, GROUP_SIZE), self.scales, self.zeros).view(n, k)

    def rows(self, rows: slice | torch.Tensor) -> Int4Tensor:
        return Int4Tensor(self.q[rows], self.scales[rows], self.zeros[rows])


def dequantize_into(out: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """out [N, groups, j] = (q - 8) * scale + zero, computed as (zero - 8 * scale) + q * scale: the offset is m
    (Q4_1) or -8d (Q4_0) exactly and q * scale is exact in float32, so each weight is rounded once, as in
    gguf's own dequantization (bit for bit)."""
    return torch.addcmul((zeros - 8 * scales)[..., None], q, scales[..., None], out=out)


def int4_from_gguf_blocks(data: np.ndarray, tensor_type: gguf.GGMLQuantizationType) -> Int4Tensor:
    """Raw Q4_0/Q4_1 bytes [N, bytes per row] → Int4Tensor [N, K], bit for bit (no rounding anywhere)."""
    n = data.shape[0]
    header = 2 if tensor_type == T.Q4_0 else 4  # float16 d, then float16 m for Q4_1
    blocks = np.ascontiguousarray(data).reshape(n, -1, header + GROUP_SIZE // 2)  # [N, groups, block bytes]
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    packed = blocks[..., header:]  # low nibbles hold weights 0..15 of the group, high nibbles 16..31
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(n, -1)
    if tensor_type == T.Q4_0:
        zeros = np.zeros_like(d)
    else:
        zeros = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) + 8 * d  # exact in float32
    return Int4Tensor(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(zeros))


class Int4Linear(nn.Module):
    """y = x W^T (+ b) with W held as group-32 int4; loaded row block by row block (q/k/v, gate/up pack)."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        if in_features % GROUP_SIZE:
            raise ValueError(f"int4 weights need in_features divisible by {GROUP_SIZE}, got {in_features}")
        self.in_features, self.out_features = in_features, out_features
        groups = in_features // GROUP_SIZE
        # GGUF's own nibble order: byte j of a group holds weight j (low nibble) and weight j + 16 (high).
        self.register_buffer("qweight", torch.empty(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scales", torch.empty(out_features, groups))
        self.register_buffer("zeros", torch.empty(out_features, groups))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        # The CPU int4 kernel's own layout of the same weight, built by pack_for_kernel once loading is done;
        # empty off the CPU (or before packing), where every call dequantizes.
        self.register_buffer("kernel_qweight", torch.empty(0, dtype=torch.uint8), persistent=False)
        self.register_buffer("kernel_scales_zeros", torch.empty(0, dtype=torch.bfloat16), persistent=False)

    def load_rows(self, rows: slice, weight: Int4Tensor) -> None:
        q = weight.q
        halves = q.view(q.shape[0], -1, 2, GROUP_SIZE // 2)  # [rows, groups, low/high, 16]
        self.qweight[rows] = (halves[:, :, 0] | (halves[:, :, 1] << 4)).flatten(1)
        self.scales[rows] = weight.scales
        self.zeros[rows] = weight.zeros

    def weight_int4(self) -> Int4Tensor:
        packed = self.qweight.view(self.out_features, -1, 1, GROUP_SIZE // 2)
        q = torch.cat([packed & 0x0F, packed >> 4], dim=2).view(self.out_features, self.in_features)
        return Int4Tensor(q, self.scales, self.zeros)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in `dtype`, each half-group written straight from its nibbles (no unpacked copy)."""
        n, groups = self.scales.shape
        packed = self.qweight.view(n, groups, GROUP_SIZE // 2)
        w = torch.empty(n, groups, 2, GROUP_SIZE // 2, dtype=torch.float32, device=packed.device)
        dequantize_into(w[:, :, 0], packed & 0x0F, self.scales, self.zeros)
        dequantize_into(w[:, :, 1], packed >> 4, self.scales, self.zeros)
        return w.view(n, self.in_features).to(dtype)

    def pack_for_kernel(self) -> None:
        """Build the CPU int4 kernel's packed weight and bfloat16 [groups, N, 2] scales/zeros (after loading)."""
        if self.qweight.device.type != "cpu":
            return
        w = self.weight_int4()
        self.kernel_qweight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.q.int(), 1)
        self.kernel_scales_zeros = torch.stack([w.scales.t(), w.zeros.t()], dim=-1).to(torch.bfloat16).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= INT4_KERNEL_MAX_ROWS and self.kernel_qweight.numel():
            # The kernel is fast with bfloat16 activations only (about 10x slower in float32).
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(torch.bfloat16), self.kernel_qweight, GROUP_SIZE, self.kernel_scales_zeros
            ).to(x.dtype)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.dequantize(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int4 group {GROUP_SIZE}"


def low_precision_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T for a weight that may be stored in a lower precision than x (a bfloat16 LM head)."""
    if weight.dtype == x.dtype:
        return F.linear(x, weight)
    if x.shape[0] <= LOW_PRECISION_MAX_ROWS:
        return F.linear(x.to(weight.dtype), weight).to(x.dtype)
    return F.linear(x, weight.to(x.dtype))
