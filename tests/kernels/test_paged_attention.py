"""tokenloop's decode-attention kernel reads the paged KV cache in place: it must give softmax(q k^T * scale) v
over exactly the slots each sequence's mask allows, in the cache's float16 or float32, with grouped-query heads."""

from __future__ import annotations

import pytest
import torch

from tokenloop import kernels

pytestmark = pytest.mark.skipif(kernels._unsupported_reason() is not None, reason=str(kernels._unsupported_reason()))


@pytest.fixture(scope="module", autouse=True)
def built():
    assert kernels.cpu_kernels_available()


def reference(q, k_cache, v_cache, key_slots, mask, scale):
    """Float64 attention over the gathered slots, one sequence at a time."""
    q_heads, kv_heads = q.shape[1], k_cache.shape[0]
    out = []
    for b in range(q.shape[0]):
        slots = key_slots[b][mask[b]]
        keys = k_cache[:, slots].double().transpose(0, 1).repeat_interleave(q_heads // kv_heads, dim=1)  # [n, q_heads, D]
        values = v_cache[:, slots].double().transpose(0, 1).repeat_interleave(q_heads // kv_heads, dim=1)
        weights = torch.softmax(torch.einsum("hd,nhd->hn", q[b].double(), keys) * scale, dim=-1)
        out.append(torch.einsum("hn,nhd->hd", weights, values))
    return torch.stack(out)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("batch,q_heads,kv_heads,head_dim,context", [(1, 9, 3, 64, 37), (5, 4, 4, 16, 8), (3, 8, 1, 256, 130), (2, 4, 2, 40, 19)])
def test_decode_attention_reads_the_allowed_slots_of_the_paged_cache(cache_dtype, batch, q_heads, kv_heads, head_dim, context):
    gen = torch.Generator().manual_seed(batch * context + head_dim)
    num_slots = 4 * context
    k_cache = torch.randn(kv_heads, num_slots, head_dim, generator=gen).to(cache_dtype)
    v_cache = torch.randn(kv_heads, num_slots, head_dim, generator=gen).to(cache_dtype)
    key_slots = torch.stack([torch.randperm(num_slots, generator=gen)[:context] for _ in range(batch)])  # scattered blocks
    lengths = torch.randint(1, context + 1, (batch,), generator=gen)
    lengths[0] = context
    mask = torch.arange(context)[None, :] < lengths[:, None]  # each sequence's own context length
    mask[0, 0] = context == 1  # a position that has left a sliding window
    q = torch.randn(batch, q_heads, head_dim, generator=gen) * 2
    scale = head_dim**-0.5
    out = torch.ops.tokenloop.paged_decode_attention(q, k_cache, v_cache, key_slots, mask, scale)
    torch.testing.assert_close(out.double(), reference(q, k_cache, v_cache, key_slots, mask, scale), atol=2e-5, rtol=1e-4)


def test_bad_inputs_raise_a_clear_error():
    q, cache = torch.randn(2, 4, 16), torch.randn(2, 8, 16)
    slots, mask = torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="mask must be a contiguous"):
        torch.ops.tokenloop.paged_decode_attention(q, cache, cache, slots, mask[:, :2], 0.25)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        torch.ops.tokenloop.paged_decode_attention(torch.randn(2, 3, 16), cache, cache, slots, mask, 0.25)
    with pytest.raises(RuntimeError, match="float16 or float32"):
        torch.ops.tokenloop.paged_decode_attention(q, cache.double(), cache.double(), slots, mask, 0.25)
