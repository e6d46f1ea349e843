"""How a KV cache block holds its tokens' keys and values, in PyTorch (kernels/kv_cache.h is the same in C++).

Per layer, the caches are [kv_heads, slots, width] tensors; slot s is position s % block_size of block
s // block_size. Each block's block_size * width elements (per KV head) are laid out for the attention
kernel's products, so that it reads them where they are, with no copy per step:
- keys dimension-major, [head_dim / k][block_size][k]: one load gives k dimensions of consecutive keys;
- values key-major, [block_size / e][head_dim][e];
e = 2 for bfloat16 and int8 (the pairs AVX512-BF16's and AVX512-VNNI's dot products multiply), 1 otherwise (values
are then plain rows); k = e, but 4 for int8 keys (the quadruples of AVX512-VNNI's byte dot product).
An int8 cache holds each token's head as 8-bit integers times a float16 scale (max |x| / 127, per token and KV
head: a token's bytes depend on that token alone, however its prompt was chunked); a block's block_size scales
follow its values, so its rows are head_dim + 2 bytes wide and the scales move with the block. Whole blocks move as
they are (copy on write, handoff); a token's K/V are written and read through this module.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 2  # an int8 cache's per-token float16 scale, stored in the block after its values


def pair_width(dtype: torch.dtype) -> int:
    return 2 if dtype in (torch.bfloat16, torch.int8) else 1


def key_width(dtype: torch.dtype) -> int:
    return 4 if dtype == torch.int8 else pair_width(dtype)


def width(head_dim: int, dtype: torch.dtype) -> int:
    """A cache row's elements for a head of head_dim values: the pool is [kv_heads, slots, width(...)]."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def head_dim(cache: torch.Tensor) -> int:
    return cache.shape[2] - SCALE_BYTES if cache.dtype == torch.int8 else cache.shape[2]


def bytes_per_token(head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one token's key or value takes in one KV head's cache, its scale included."""
    return width(head_dim, dtype) * dtype.itemsize


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] as int8 q and float16 scales [...] with x ≈ q * scale: scale = max |x| / 127 rounded to
    float16, q = x / scale rounded half to even (0 where x is all zeros). The C++ kernels round alike."""
    x = x.float()
    scale = (x.abs().amax(dim=-1) / 127).to(torch.float16)
    s = scale.float().unsqueeze(-1)
    q = torch.where(s > 0, torch.round(x / s).clamp(-127, 127), 0)
    return q.to(torch.int8), scale


def _blocks(cache: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The cache's elements as [kv_heads, blocks, block_size * head_dim] and, for int8, its scales
    [kv_heads, blocks, block_size] (views)."""
    kv_heads, slots, _ = cache.shape
    d = head_dim(cache)
    flat = cache.view(kv_heads, slots // block_size, -1)
    if cache.dtype != torch.int8:
        return flat, None
    return flat[..., : block_size * d], flat[..., block_size * d :].view(torch.float16)


def _keys(cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """The keys as [kv_heads, blocks, block_size, head_dim / k, k]: a view, indexed by position and dimension."""
    elements, _ = _blocks(cache, block_size)
    e = key_width(cache.dtype)
    return elements.unflatten(2, (head_dim(cache) // e, block_size, e)).transpose(2, 3)


def _values(cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """The values as [kv_heads, blocks, block_size / e, e, head_dim]: a view; positions 2m, 2m + 1 are [m, 0] and
    [m, 1]."""
    elements, _ = _blocks(cache, block_size)
    e = pair_width(cache.dtype)
    return elements.unflatten(2, (block_size // e, head_dim(cache), e)).transpose(3, 4)


def write(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_size: int
) -> None:
    """Token t's k[t] and v[t] ([T, kv_heads, head_dim] each) into slot slots[t]."""
    blocks, at = slots // block_size, slots % block_size
    if k_cache.dtype == torch.int8:
        (k, k_scale), (v, v_scale) = quantize(k), quantize(v)
        _blocks(k_cache, block_size)[1].permute(1, 2, 0)[blocks, at] = k_scale
        _blocks(v_cache, block_size)[1].permute(1, 2, 0)[blocks, at] = v_scale
    keys = k.unflatten(2, (-1, key_width(k_cache.dtype))).to(k_cache.dtype)
    _keys(k_cache, block_size).permute(1, 2, 0, 3, 4)[blocks, at] = keys
    e = pair_width(v_cache.dtype)
    _values(v_cache, block_size).permute(1, 2, 3, 0, 4)[blocks, at // e, at % e] = v.to(v_cache.dtype)


def rows(k_cache: torch.Tensor, v_cache: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values as plain rows, [kv_heads, slots, head_dim] each (copies; an int8 cache's dequantized to
    float32): of a whole cache, or of any tensor of whole blocks in its layout."""
    kv_heads, slots, _ = k_cache.shape
    shape = (kv_heads, slots, head_dim(k_cache))
    keys, values = _keys(k_cache, block_size).reshape(shape), _values(v_cache, block_size).reshape(shape)
    if k_cache.dtype != torch.int8:
        return keys, values
    k_scale, v_scale = (_blocks(c, block_size)[1].reshape(kv_heads, slots, 1).float() for c in (k_cache, v_cache))
    return keys.float() * k_scale, values.float() * v_scale


def from_rows(
    keys: torch.Tensor, values: torch.Tensor, block_size: int, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of rows(): caches of `dtype` (default: the rows') in the block layout holding these
    [kv_heads, slots, head_dim] rows."""
    dtype = dtype or keys.dtype
    kv_heads, slots, d = keys.shape
    k_cache, v_cache = (keys.new_zeros(kv_heads, slots, width(d, dtype), dtype=dtype) for _ in range(2))
    every = torch.arange(slots, device=keys.device)
    write(k_cache, v_cache, every, keys.transpose(0, 1), values.transpose(0, 1), block_size)
    return k_cache, v_cache
