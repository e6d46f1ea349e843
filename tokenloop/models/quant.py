"""Weights that stay quantized: GGUF blocks mapped exactly onto the two forms tokenloop's CPU kernel computes.

- int4, one scale and one offset per group of 32 along K: w = q * scale + offset, q in 0..15. Q4_1 is
  w = q * d + m, Q4_0 is (q - 8) * d, Q4_K is d * sc * q - dmin * m per sub-block of 32 (its scales and offsets
  held as the file holds them: 6-bit integers times a float16 per 256 weights, `FactoredScales`).
- int8, one scale per group of 32 (or 16) along K: w = q * scale. Q8_0 is q * d, Q6_K is d * sc * (q - 32) per
  group of 16.
- int5, int8 values in -16..15 held in 5 bits (nibbles and fifth bits, as the file has them): Q5_0, (q - 16) * d.
The integers need no requantization; `ggml_types.py` maps each GGML type onto its form.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tokenloop import kernels

GROUP_SIZE = 32
INTERLEAVED_ROWS = 8  # the int4 kernel's weight rows come in interleaved groups of this many
LOW_PRECISION_MAX_ROWS = 16


SUPER_BLOCK = 256  # weights per K-quant super-block: one float16 scale (and min) each
FACTORED_DTYPES = (torch.uint8, torch.int8)  # scale dtypes that are integers times a float16 per super-block


@dataclass(frozen=True, slots=True)
class QuantLayout:
    """How a weight is held: its bits, its scales' dtype (float16 as a file's; float32; or uint8 / int8 for a
    K-quant's small integers times a float16 per 256 weights, FactoredScales) and the weights per scale. Shards
    packed into one module must share it."""

    bits: int  # 4 (with offsets), 5 or 8
    scale_dtype: torch.dtype
    group: int = GROUP_SIZE  # 32, or 16 (int8 only)

    @property
    def factored(self) -> bool:
        return self.scale_dtype in FACTORED_DTYPES

    def describe_scales(self) -> str:
        return f"{self.scale_dtype} scales" + (" times a float16 per 256" if self.factored else "")

    def widened(self) -> QuantLayout:
        """The layout that also holds this one's weights exactly: 5 bits widen to 8 (a module whose shards come
        as Q5_0 and Q8_0 keeps both quantized, as int8)."""
        return QuantLayout(8, self.scale_dtype, self.group) if self.bits == 5 else self


@dataclass(slots=True)
class FactoredScales:
    """Scales (or offsets) as a K-quant file holds them: small integers, one per 16 or 32 weights, times a float16
    per 256 weights. Each product is exact in float32 (11 bits times at most 8), so `float()` gives the same values
    a float32 copy would hold, in a fifth to a quarter of the bytes."""

    sub: torch.Tensor  # [N, K / group] uint8 (Q4_K's 6-bit scales and mins) or int8 (Q6_K's scales)
    per_256: torch.Tensor  # [N, K / 256] float16 (d, or -dmin for offsets)

    @property
    def shape(self) -> torch.Size:
        return self.sub.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.sub.dtype

    def float(self) -> torch.Tensor:
        per_super = self.sub.shape[1] // self.per_256.shape[1]
        return self.per_256.float().repeat_interleave(per_super, dim=1) * self.sub.float()

    def __getitem__(self, rows: slice | torch.Tensor) -> FactoredScales:
        return FactoredScales(self.sub[rows], self.per_256[rows])


Scales = torch.Tensor | FactoredScales


@dataclass(slots=True)
class Int4Tensor:
    """A [N, K] weight as 4-bit integers with one scale and zero per group of 32 along K."""

    q: torch.Tensor  # [N, K] uint8 in 0..15
    scales: Scales  # [N, K / 32] float16 (as in the file), float32 or factored
    offsets: Scales  # [N, K / 32], as the scales

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @property
    def layout(self) -> QuantLayout:
        return QuantLayout(4, self.scales.dtype)

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        w = torch.empty(n, k // GROUP_SIZE, GROUP_SIZE, dtype=torch.float32, device=self.q.device)
        return dequantize_into(w, self.q.view(n, k // GROUP_SIZE, GROUP_SIZE), self.scales, self.offsets).view(n, k)

    def rows(self, rows: slice | torch.Tensor) -> Int4Tensor:
        return Int4Tensor(self.q[rows], self.scales[rows], self.offsets[rows])


def dequantize_into(out: torch.Tensor, q: torch.Tensor, scales: Scales, offsets: Scales) -> torch.Tensor:
    """out [N, groups, j] = offset + q * scale in float32: q * scale is exact (a float16 d, or d times a 6-bit
    integer, times 4 bits), so each weight is rounded once, as in gguf's own dequantization (bit for bit)."""
    return torch.addcmul(offsets.float()[..., None], q, scales.float()[..., None], out=out)


@dataclass(slots=True)
class Int8Tensor:
    """A [N, K] weight as int8 with one scale per group of 32 (or 16) along K: w = q * scale."""

    q: torch.Tensor  # [N, K] int8
    scales: Scales  # [N, K / group] float16 (as in the file), float32 or factored

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @property
    def group(self) -> int:
        return self.q.shape[1] // self.scales.shape[1]

    @property
    def layout(self) -> QuantLayout:
        return QuantLayout(8, self.scales.dtype, self.group)

    def dequantize(self) -> torch.Tensor:
        """q * scale, one rounding of exact operands, as in gguf's own dequantization (bit for bit)."""
        n, k = self.q.shape
        return (self.q.view(n, k // self.group, self.group) * self.scales.float()[..., None]).view(n, k)

    def rows(self, rows: slice | torch.Tensor) -> Int8Tensor:
        return Int8Tensor(self.q[rows], self.scales[rows])


class QuantizedModule(nn.Module):
    """A module whose weight stays in the file's integers (`qweight`, float16 `scales` per group of 32, and
    `offsets` for int4), loaded row block by row block, and multiplied by tokenloop's CPU kernel where that
    can run.

    The rows are stored in groups of 8, interleaved for the kernel (layout in quantized_matmul.cpp): one vector
    instruction then multiplies 4 weights of 8 rows at once. The row count is padded to a multiple of 8 with
    zero rows, whose outputs are dropped."""

    cpu_kernel = False  # set by use_cpu_kernel once the weights are loaded
    # The form, set by each subclass: the ops that multiply it (torch.ops.tokenloop.{kernel}_matmul and
    # _gated_matmul), the bytes one row's 32 weights take, their dtype, and whether it has offsets.
    kernel = "q8"
    block_bytes = GROUP_SIZE
    qdtype = torch.int8
    has_offsets = False

    def __init__(self, rows: int, cols: int, layout: QuantLayout, bias: bool = False) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.empty(rows)) if bias else None
        if cols % GROUP_SIZE:
            raise ValueError(f"{type(self).__name__} needs a row length divisible by {GROUP_SIZE}, got {cols}")
        if layout.factored and cols % SUPER_BLOCK:
            raise ValueError(
                f"{type(self).__name__} with K-quant scales needs a row length divisible by {SUPER_BLOCK}, got {cols}"
            )
        self.rows, self.cols = rows, cols
        self.layout = layout
        self.sub_blocks = GROUP_SIZE // layout.group  # scales per block of 32
        row_groups, groups = -(-rows // INTERLEAVED_ROWS), cols // GROUP_SIZE
        self.register_buffer(
            "qweight", torch.zeros(row_groups, groups, INTERLEAVED_ROWS * self.block_bytes, dtype=self.qdtype)
        )
        # [row group, group, sub-block, row in group] flattened: the 8 rows' scales of each sub-block in turn
        self.register_buffer(
            "scales", torch.zeros(row_groups, groups, self.sub_blocks * INTERLEAVED_ROWS, dtype=layout.scale_dtype)
        )
        # Buffers by shape, not zeros_like: on the meta device that runs a Python reference that imports sympy
        # (32 MB resident).
        offsets = torch.zeros(self.scales.shape, dtype=self.scales.dtype) if self.has_offsets else None
        self.register_buffer("offsets", offsets)
        # Factored scales' float16s: [row group, super-block, row in group], the 8 rows' factor of each super-block
        per_256_shape = (row_groups, cols // SUPER_BLOCK, INTERLEAVED_ROWS)
        per_256 = torch.zeros(per_256_shape, dtype=torch.float16) if layout.factored else None
        self.register_buffer("scales_per_256", per_256)
        offsets_per_256 = (
            torch.zeros(per_256_shape, dtype=torch.float16) if layout.factored and self.has_offsets else None
        )
        self.register_buffer("offsets_per_256", offsets_per_256)

    @property
    def weight_shape(self) -> tuple[int, int]:
        return self.rows, self.cols

    def _blocks(self) -> torch.Tensor:
        """qweight as [row group, row in group, group, chunk, 4 bytes], a row's block bytes in order along the
        last two: a view, so it reads and writes."""
        row_groups, groups, _ = self.qweight.shape
        return self.qweight.view(row_groups, groups, self.block_bytes // 4, INTERLEAVED_ROWS, 4).permute(0, 3, 1, 2, 4)

    def _per_row(self, buffer: torch.Tensor) -> torch.Tensor:
        """A scales (or offsets) buffer as [row group, row in group, group, sub-block]: a view."""
        row_groups, groups, _ = buffer.shape
        return buffer.view(row_groups, groups, self.sub_blocks, INTERLEAVED_ROWS).permute(0, 3, 1, 2)

    def _scale_buffers(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """(scales, their per-256 factors or None), and the same for offsets where the form has them."""
        pairs = [(self.scales, self.scales_per_256)]
        return pairs if self.offsets is None else [*pairs, (self.offsets, self.offsets_per_256)]

    def _store_rows(self, rows: slice, blocks: torch.Tensor, scales: Scales, offsets: Scales | None) -> None:
        """Write rows given as [n, groups, block_bytes] bytes and [n, groups * sub-blocks] scales (and offsets)."""
        index = torch.arange(self.rows)[rows]
        at = (index // INTERLEAVED_ROWS, index % INTERLEAVED_ROWS)
        self._blocks()[at] = blocks.reshape(len(index), -1, self.block_bytes // 4, 4)
        for (buffer, per_256), values in zip(self._scale_buffers(), (scales, offsets)):
            if per_256 is not None:  # the factored form's integers here, its float16 factors there
                per_256.permute(0, 2, 1)[at] = values.per_256
                values = values.sub
            self._per_row(buffer)[at] = values.reshape(len(index), -1, self.sub_blocks).to(buffer.dtype)

    def _read_rows(self, index: torch.Tensor) -> tuple[torch.Tensor, Scales, Scales | None]:
        """Rows `index` (1-D) as [n, groups, block_bytes] bytes and [n, groups * sub-blocks] scales and offsets."""
        at = (index // INTERLEAVED_ROWS, index % INTERLEAVED_ROWS)
        blocks = self._blocks()[at].flatten(-2)
        scales: list[Scales | None] = [None, None]
        for i, (buffer, per_256) in enumerate(self._scale_buffers()):
            values = self._per_row(buffer)[at].flatten(-2)
            scales[i] = values if per_256 is None else FactoredScales(values, per_256.permute(0, 2, 1)[at])
        return blocks, scales[0], scales[1]

    def _all_rows(self) -> tuple[torch.Tensor, Scales, Scales | None]:
        return self._read_rows(torch.arange(self.rows, device=self.qweight.device))

    def _drop_padding(self, y: torch.Tensor) -> torch.Tensor:
        return y if y.shape[-1] == self.rows else y[..., : self.rows]

    def load_rows(self, rows: slice, weight: Int4Tensor | Int8Tensor) -> None:
        raise NotImplementedError

    def use_cpu_kernel(self) -> None:
        """Products go through the kernel, which reads qweight as it is, when the weights are on a CPU that
        can run it."""
        self.cpu_kernel = self.qweight.device.type == "cpu" and kernels.cpu_kernels_available()

    def _kernel_product(self, x: torch.Tensor, activation: str | None = None) -> torch.Tensor:
        """x W^T (+ b) through the kernel (cpu_kernel must be set) in x's dtype, or with an activation
        (act(gate) * up) W^T (+ b) for x = [gate | up]."""
        ops, xf = torch.ops.tokenloop, x.float().contiguous()
        buffers = self._scale_buffers()
        weights = (self.qweight, *(values for values, _ in buffers))
        factors = tuple(f for _, f in buffers if f is not None)  # the factored form's per-256 floats
        if activation is None:
            y = getattr(ops, f"{self.kernel}_matmul")(xf, *weights, *factors)
        else:
            y = getattr(ops, f"{self.kernel}_gated_matmul")(xf, *weights, activation, *factors)
        y = self._drop_padding(y).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def gated_forward(self, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
        """forward(act(gate) * up) for gate_up = [gate | up], a gated MLP's down projection, through the CPU
        kernel (cpu_kernel must be set): it computes the product block by block as it quantizes its input,
        instead of in two more passes over it."""
        return self._kernel_product(gate_up, activation)


class Int4Linear(QuantizedModule):
    """y = x W^T (+ b) with W held as group-32 int4; loaded row block by row block (q/k/v, gate/up pack)."""

    kernel = "q4"
    block_bytes = GROUP_SIZE // 2
    qdtype = torch.uint8
    has_offsets = True

    def __init__(
        self, in_features: int, out_features: int, bias: bool, layout: QuantLayout = QuantLayout(4, torch.float16)
    ) -> None:
        super().__init__(out_features, in_features, layout, bias)
        self.in_features, self.out_features = in_features, out_features

    def load_rows(self, rows: slice, weight: Int4Tensor) -> None:
        q = weight.q.view(weight.q.shape[0], -1, 2, GROUP_SIZE // 2)  # [rows, groups, low/high, 16]
        self._store_rows(rows, q[:, :, 0] | (q[:, :, 1] << 4), weight.scales, weight.offsets)  # GGUF's nibble order

    def weight_int4(self) -> Int4Tensor:
        packed, scales, offsets = self._all_rows()
        q = torch.cat([packed & 0x0F, packed >> 4], dim=2).view(self.out_features, self.in_features)
        return Int4Tensor(q, scales, offsets)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_kernel:
            return self._kernel_product(x)
        return F.linear(x, self.weight_int4().dequantize().to(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"int4 group {GROUP_SIZE}, {self.layout.describe_scales()}"
        )


class Int8Weights(QuantizedModule):
    """Rows of int8 weights with a scale per group of 32 (or 16), multiplied by the q8 kernel."""

    def __init__(self, rows: int, cols: int, layout: QuantLayout, bias: bool = False) -> None:
        super().__init__(rows, cols, layout, bias)

    def load_rows(self, rows: slice, weight: Int8Tensor) -> None:
        self._store_rows(rows, weight.q.view(weight.q.shape[0], -1, GROUP_SIZE), weight.scales, None)

    def weight_int8(self) -> Int8Tensor:
        q, scales, _ = self._all_rows()
        return Int8Tensor(q.view(self.rows, self.cols), scales)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T (+ b) in x's dtype."""
        if self.cpu_kernel:
            return self._kernel_product(x)
        return F.linear(x, self.weight_int8().dequantize().to(x.dtype), self.bias)

    def select_rows(self, index: torch.Tensor) -> Int8Linear:
        """A module of rows `index` (1-D) only, the same int8 values and scales: its products are those rows' of
        this one's (a draft vocabulary's slice of the LM head, read at a fraction of the bytes)."""
        q, scales, _ = self._read_rows(index)
        part = Int8Linear(self.cols, len(index), bias=False, layout=self.layout).to(self.qweight.device)
        part._store_rows(slice(None), q, scales, None)
        part.cpu_kernel = self.cpu_kernel  # multiplied as this one is
        return part


class Int8Linear(Int8Weights):
    """y = x W^T (+ b) with W held as int8 (GGUF Q8_0, Q6_K, and Q5_0 packed with Q8_0 in one module)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, layout: QuantLayout = QuantLayout(8, torch.float16)
    ) -> None:
        super().__init__(out_features, in_features, layout, bias)
        self.in_features, self.out_features = in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"int8 group {self.layout.group}, {self.layout.describe_scales()}"
        )


class Int5Linear(Int8Linear):
    """y = x W^T (+ b) with W = (u - 16) * scale held in 5 bits, u in 0..31 (GGUF Q5_0), loaded from int8 values in
    -16..15: per row and block of 32, u's 16 bytes of nibbles as Int4Linear's, then its 4 bytes of fifth bits (bit
    j: weight j's), as the file has them. A decode step reads 24 bytes per 32 weights instead of int8's 34; the
    kernel's products are the same floats as int8's."""

    kernel = "q5"
    block_bytes = GROUP_SIZE // 2 + GROUP_SIZE // 8
    qdtype = torch.uint8

    def __init__(
        self, in_features: int, out_features: int, bias: bool, layout: QuantLayout = QuantLayout(5, torch.float16)
    ) -> None:
        super().__init__(in_features, out_features, bias, layout)

    def load_rows(self, rows: slice, weight: Int8Tensor) -> None:
        q = weight.q.view(weight.q.shape[0], -1, GROUP_SIZE)
        if q.numel() and (q.min() < -16 or q.max() > 15):
            raise ValueError(f"Int5Linear holds weights in -16..15, got {q.min().item()}..{q.max().item()}")
        u = (q + 16).view(torch.uint8)
        nibbles = (u[..., :16] & 0x0F) | ((u[..., 16:] & 0x0F) << 4)  # GGUF's order: weight j low, j + 16 high
        bits = (u >> 4).view(*u.shape[:-1], 4, 8) << torch.arange(8, dtype=torch.uint8, device=u.device)
        fifth = bits.sum(-1, dtype=torch.uint8)  # disjoint bits: the sum is their or
        self._store_rows(rows, torch.cat([nibbles, fifth], dim=-1), weight.scales, None)

    def weight_int8(self) -> Int8Tensor:
        blocks, scales, _ = self._all_rows()
        nibbles, fifth = blocks[..., :16], blocks[..., 16:]
        bits = (fifth[..., None] >> torch.arange(8, dtype=torch.uint8, device=fifth.device)) & 1
        u = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1) | (bits.flatten(-2) << 4)
        return Int8Tensor((u.view(torch.int8) - 16).view(self.rows, self.cols), scales)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"int5 group {GROUP_SIZE}, {self.layout.describe_scales()}"
        )


class Int8Embedding(Int8Weights):
    """A token embedding held as int8 (GGUF Q8_0) that, tied, is the LM head too: `logits` runs tokenloop's
    CPU kernel, which reads a quarter of the bytes a float32 head would."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, layout: QuantLayout = QuantLayout(8, torch.float16)
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, layout)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        q, scales, _ = self._read_rows(input_ids.flatten())
        rows = Int8Tensor(q.reshape(-1, self.embedding_dim), scales).dequantize()
        return rows.view(*input_ids.shape, self.embedding_dim)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 group {self.layout.group}"


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b) for an unquantized weight of x's dtype. Float32 on the CPU goes through tokenloop's kernel for
    every row count: each row gets the same floats whatever the rows beside it, the row count or the thread count
    (decode, verify and a prefill chunk of any size agree), and a few rows cost about one pass over the weights."""
    if (
        x.dtype == weight.dtype == torch.float32
        and x.device.type == "cpu"
        and x.dim() == 2
        and kernels.cpu_kernels_available()
    ):
        y = torch.ops.tokenloop.f32_matmul(x, weight)
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


def low_precision_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T for a weight that may be stored in a lower precision than x (a bfloat16 LM head)."""
    if weight.dtype == x.dtype:
        return dense_linear(x, weight)
    if x.shape[0] <= LOW_PRECISION_MAX_ROWS:
        return F.linear(x.to(weight.dtype), weight).to(x.dtype)
    return F.linear(x, weight.to(x.dtype))
