"""tokenloop's prefill attention (bfloat16 products, float32 softmax and sums) against SDPA in float32 over the same
context: causal and windowed, a whole prompt and a chunk after cached tokens, grouped-query heads of 256 and 64
dimensions, slots in any order, float16 and float32 caches. Its errors are bfloat16 roundings (about 0.4% of an
output's size); a window one key off, or a chunk read from the wrong position, is far outside them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenloop import kernels

pytestmark = pytest.mark.skipif(not kernels.prefill_attention_available(), reason="no AVX512-BF16 here: attention runs SDPA")


def sdpa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, first: int, window: int, scale: float) -> torch.Tensor:
    """The same attention in float32 SDPA: query i at position first + i, key j at position j."""
    num_q, heads, d = q.shape
    keys, values = k_cache[:, slots].float()[None], v_cache[:, slots].float()[None]
    q_pos, k_pos = first + torch.arange(num_q)[:, None], torch.arange(slots.numel())[None]
    mask = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, attn_mask=mask[None, None], scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(num_q, heads * d)


def case(num_q: int, first: int, heads: int, kv_heads: int, d: int, cache_dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    num_slots = first + num_q + 40
    k_cache = torch.randn(kv_heads, num_slots, d, generator=gen).to(cache_dtype)
    v_cache = torch.randn(kv_heads, num_slots, d, generator=gen).to(cache_dtype)
    slots = torch.randperm(num_slots, generator=gen)[: first + num_q]
    qkv = 2 * torch.randn(num_q, (heads + 2 * kv_heads) * d, generator=gen)  # q as the model passes it: a view of qkv
    return qkv[:, : heads * d].view(num_q, heads, d), k_cache, v_cache, slots


@pytest.mark.parametrize("num_q,first,heads,kv_heads,d,window,cache_dtype", [
    (300, 0, 4, 1, 256, 0, torch.float16),  # Gemma 3's heads, a prompt, full layer
    (300, 0, 4, 1, 256, 64, torch.float16),  # ... sliding layer
    (45, 200, 4, 1, 256, 100, torch.float16),  # a chunk after 200 cached tokens, its window reaching back into them
    (37, 100, 9, 3, 64, 0, torch.float32),  # SmolLM2's heads (3 query heads a KV head), a chunk
    (70, 5, 9, 3, 64, 16, torch.float16),
    (1, 0, 4, 1, 256, 0, torch.float16),  # a one-token prompt
])
def test_matches_float32_sdpa_up_to_bfloat16_rounding(num_q, first, heads, kv_heads, d, window, cache_dtype):
    q, k_cache, v_cache, slots = case(num_q, first, heads, kv_heads, d, cache_dtype)
    out = torch.ops.tokenloop.prefill_attention(q, k_cache, v_cache, slots, first, window, d**-0.5)
    expected = sdpa(q, k_cache, v_cache, slots, first, window, d**-0.5)
    error = (out - expected).abs()
    assert error.mean() < 0.01 * expected.abs().mean() and error.max() < 0.05, (error.mean(), error.max())
    # A window one key wider, and each query one position later (seeing the key after its own): far outside.
    later = torch.cat([slots, torch.tensor([k_cache.shape[1] - 1])])
    wrongs = [sdpa(q, k_cache, v_cache, later, first + 1, window, d**-0.5)] + ([sdpa(q, k_cache, v_cache, slots, first, window + 1, d**-0.5)] if window else [])
    for wrong in wrongs:
        assert (out - wrong).abs().mean() > 3 * error.mean()


def test_bad_inputs_raise_a_clear_error():
    q, k_cache, v_cache, slots = case(8, 4, 4, 1, 64, torch.float16)
    attend = torch.ops.tokenloop.prefill_attention
    with pytest.raises(RuntimeError, match="key_slots must be"):
        attend(q, k_cache, v_cache, slots[:-1], 4, 0, 0.125)
    with pytest.raises(RuntimeError, match="q must be"):
        attend(q.double(), k_cache, v_cache, slots, 4, 0, 0.125)
    with pytest.raises(RuntimeError, match="head_dim must be a multiple of 64"):
        attend(q[..., :32], k_cache[..., :32].contiguous(), v_cache[..., :32].contiguous(), slots, 4, 0, 0.125)
    with pytest.raises(RuntimeError, match="slot 999 is outside"):
        attend(q, k_cache, v_cache, torch.cat([slots[:-1], torch.tensor([999])]), 4, 0, 0.125)
    with pytest.raises(RuntimeError, match="window must be"):
        attend(q, k_cache, v_cache, slots, 4, -1, 0.125)
