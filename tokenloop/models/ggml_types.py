"""The GGML types the fast path keeps quantized: one table from each type to its converter (raw GGUF blocks →
the file's own integers and scales, no rounding anywhere) and so to its layout and module. A new format is one
converter and one row here; which module holds it follows from its layout (models/quant.py).

Every converter reads the block layout that gguf's own `dequantize_blocks` reads (gguf/quants.py), and its
tensor's `dequantize()` equals gguf's dequantization bit for bit (tests/models/test_ggml_types.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import gguf
import numpy as np
import torch

from tokenloop.models.quant import GROUP_SIZE, FactoredScales, Int4Tensor, Int8Tensor, QuantLayout

T = gguf.GGMLQuantizationType
QK_K = 256  # weights per K-quant super-block


def _halves(raw: np.ndarray) -> np.ndarray:
    """[..., 2] bytes → [...] float16."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0]


def _blocks(data: np.ndarray, block_bytes: int) -> np.ndarray:
    """Raw rows [N, bytes per row] → [N, blocks, block_bytes]."""
    return np.ascontiguousarray(data).reshape(data.shape[0], -1, block_bytes)


def q4_0_or_1(tensor_type: gguf.GGMLQuantizationType) -> Callable[[np.ndarray], Int4Tensor]:
    """Q4_0 (w = (q - 8) d) and Q4_1 (w = q d + m): float16 d (and m), 16 bytes of nibbles (low: weights 0..15)."""
    header = 2 if tensor_type == T.Q4_0 else 4

    def convert(data: np.ndarray) -> Int4Tensor:
        blocks = _blocks(data, header + GROUP_SIZE // 2)
        d = _halves(blocks[..., 0:2])
        packed = blocks[..., header:]
        q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(data.shape[0], -1)
        offsets = (
            d * np.float16(-8) if tensor_type == T.Q4_0 else _halves(blocks[..., 2:4])
        )  # -8d: exact, a power of two
        return Int4Tensor(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(offsets))

    return convert


def q4_k(data: np.ndarray) -> Int4Tensor:
    """Q4_K: super-blocks of 256 = float16 d and dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32,
    128 bytes of nibbles (32 bytes per pair of sub-blocks: low nibbles the first, high the second).
    w = (d * sc) q - dmin * m: scale sc times d and offset m times -dmin, as the file holds them (FactoredScales)."""
    n = data.shape[0]
    blocks = _blocks(data, 2 + 2 + 12 + QK_K // 2)  # [N, S, 144]
    d, dmin = _halves(blocks[..., 0:2]), _halves(blocks[..., 2:4])  # [N, S]
    sc, m = gguf.quants.Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12))
    nibbles = blocks[..., 16:].reshape(n, -1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    q = (nibbles & 0x0F).reshape(n, -1)
    scales = FactoredScales(torch.from_numpy(sc.reshape(n, -1).astype(np.uint8)), torch.from_numpy(d))
    offsets = FactoredScales(torch.from_numpy(m.reshape(n, -1).astype(np.uint8)), torch.from_numpy(-dmin))
    return Int4Tensor(torch.from_numpy(q), scales, offsets)


def q8_0(data: np.ndarray) -> Int8Tensor:
    """Q8_0: float16 d, 32 int8. w = q d."""
    blocks = _blocks(data, 2 + GROUP_SIZE)
    q = blocks[..., 2:].copy().view(np.int8).reshape(data.shape[0], -1)
    return Int8Tensor(torch.from_numpy(q), torch.from_numpy(_halves(blocks[..., 0:2])))


def q5_0(data: np.ndarray) -> Int8Tensor:
    """Q5_0: float16 d, 4 bytes of fifth bits (bit j: weight j), 16 bytes of nibbles. w = (q - 16) d: int8 q - 16
    with the file's d, Q8_0's form, which Int5Linear holds in 5 bits again."""
    n = data.shape[0]
    blocks = _blocks(data, 2 + 4 + GROUP_SIZE // 2)
    high = blocks[..., 2:6].copy().view(np.uint32)  # [N, B, 1]
    high = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [N, B, 32]
    low = blocks[..., 6:]
    low = np.concatenate([low & 0x0F, low >> 4], axis=-1)
    q = (low | (high << 4)).astype(np.int8) - np.int8(16)
    return Int8Tensor(torch.from_numpy(q.reshape(n, -1)), torch.from_numpy(_halves(blocks[..., 0:2])))


def q6_k(data: np.ndarray) -> Int8Tensor:
    """Q6_K: super-blocks of 256 = 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales (one per 16
    weights), float16 d. w = (d * sc) (q - 32): int8 q - 32, and the file's int8 scales times its d (FactoredScales)."""
    n = data.shape[0]
    blocks = _blocks(data, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2).reshape(-1, 210)  # [N * S, 210]
    ql, qh = blocks[:, : QK_K // 2], blocks[:, QK_K // 2 : QK_K // 2 + QK_K // 4]
    sc = blocks[:, 192:208].copy().view(np.int8)
    d = _halves(blocks[:, 208:210])
    low = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03
    q = (low.reshape(-1, 8, 32) | (high.reshape(-1, 8, 32) << 4)).astype(np.int8) - np.int8(32)
    scales = FactoredScales(torch.from_numpy(sc.reshape(n, -1)), torch.from_numpy(d.reshape(n, -1)))
    return Int8Tensor(torch.from_numpy(q.reshape(n, -1)), scales)


@dataclass(frozen=True, slots=True)
class GGMLFormat:
    convert: Callable[[np.ndarray], Int4Tensor | Int8Tensor]  # raw rows [N, bytes per row] → the tensor
    layout: QuantLayout  # what convert returns, known before any weight is read (the model is built first)


F16 = torch.float16
GGML_FORMATS: dict[gguf.GGMLQuantizationType, GGMLFormat] = {
    T.Q4_0: GGMLFormat(q4_0_or_1(T.Q4_0), QuantLayout(4, F16)),
    T.Q4_1: GGMLFormat(q4_0_or_1(T.Q4_1), QuantLayout(4, F16)),
    T.Q4_K: GGMLFormat(q4_k, QuantLayout(4, torch.uint8)),
    T.Q8_0: GGMLFormat(q8_0, QuantLayout(8, F16)),
    T.Q5_0: GGMLFormat(q5_0, QuantLayout(5, F16)),
    T.Q6_K: GGMLFormat(q6_k, QuantLayout(8, torch.int8, group=16)),
}
