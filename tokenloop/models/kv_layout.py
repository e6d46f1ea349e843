"""How a KV cache block holds its tokens' keys and values, in PyTorch (kernels/kv_cache.h is the same in C++).

Per layer, the caches are [kv_heads, slots, head_dim] tensors; slot s is position s % block_size of block
s // block_size. Each block's block_size * head_dim elements (per KV head) are laid out for the attention
kernel's products, so that it reads them where they are, with no copy per step:
- keys dimension-major, [head_dim / e][block_size][e]: one load gives a dimension (pair) of consecutive keys;
- values key-major, [block_size / e][head_dim][e];
e = 2 for bfloat16 (the pairs AVX512-BF16's dot product multiplies), 1 otherwise (values are then plain rows).
Whole blocks move as they are (copy on write); a token's K/V are written and read through this module.
"""

from __future__ import annotations

import torch


def pair_width(dtype: torch.dtype) -> int:
    return 2 if dtype == torch.bfloat16 else 1


def _keys(cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """The cache as [kv_heads, blocks, block_size, head_dim / e, e]: a view, indexed by position and dimension."""
    kv_heads, slots, d = cache.shape
    e = pair_width(cache.dtype)
    return cache.view(kv_heads, slots // block_size, d // e, block_size, e).transpose(2, 3)


def _values(cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """The cache as [kv_heads, blocks, block_size / e, e, head_dim]: a view; positions 2m, 2m + 1 are [m, 0], [m, 1]."""
    kv_heads, slots, d = cache.shape
    e = pair_width(cache.dtype)
    return cache.view(kv_heads, slots // block_size, block_size // e, d, e).transpose(3, 4)


def write(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_size: int
) -> None:
    """Token t's k[t] and v[t] ([T, kv_heads, head_dim] each) into slot slots[t]."""
    blocks, at = slots // block_size, slots % block_size
    e = pair_width(k_cache.dtype)
    _keys(k_cache, block_size).permute(1, 2, 0, 3, 4)[blocks, at] = k.unflatten(2, (-1, e)).to(k_cache.dtype)
    _values(v_cache, block_size).permute(1, 2, 3, 0, 4)[blocks, at // e, at % e] = v.to(v_cache.dtype)


def rows(k_cache: torch.Tensor, v_cache: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values as plain rows, [kv_heads, slots, head_dim] each (copies): of a whole cache, or of any tensor
    of whole blocks in its layout."""
    shape = k_cache.shape
    return _keys(k_cache, block_size).reshape(shape), _values(v_cache, block_size).reshape(shape)


def from_rows(keys: torch.Tensor, values: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of rows(): caches in the block layout holding these [kv_heads, slots, head_dim] rows."""
    k_cache, v_cache = torch.empty_like(keys), torch.empty_like(values)
    _keys(k_cache, block_size).copy_(keys.view(_keys(k_cache, block_size).shape))
    _values(v_cache, block_size).copy_(values.view(_values(v_cache, block_size).shape))
    return k_cache, v_cache
