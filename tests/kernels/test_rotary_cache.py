"""tokenloop's rotary + cache-write kernel stands in for eager ops (apply_rotary, then index_copy_ into the
cache): it must give the same floats, bit for bit, and leave v and the untouched slots alone. With Gemma 3's
per-head query and key norms first, the same floats but for the order of each norm's sum of squares."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenloop import kernels
from tokenloop.models import kv_layout
from tokenloop.models.layers import RotaryEmbedding, apply_rotary

pytestmark = pytest.mark.skipif(kernels._unsupported_reason() is not None, reason=str(kernels._unsupported_reason()))


@pytest.fixture(scope="module", autouse=True)
def built():
    assert kernels.cpu_kernels_available()


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int8])
@pytest.mark.parametrize("tokens,q_heads,kv_heads,head_dim", [(37, 9, 3, 64), (5, 4, 1, 256), (1, 2, 2, 16)])
def test_rotates_q_and_k_in_place_and_writes_k_and_v_to_their_slots(
    qk_norm, cache_dtype, tokens, q_heads, kv_heads, head_dim
):
    gen = torch.Generator().manual_seed(tokens * head_dim)
    rotary = RotaryEmbedding(head_dim, 4096, 10000.0, None)
    cos, sin = rotary.tables(torch.randint(0, 4096, (tokens,), generator=gen))
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=gen)
    block_size = 16
    num_slots = -(-(3 * tokens + 5) // block_size) * block_size
    slots = torch.randperm(num_slots, generator=gen)[:tokens]
    k_cache, v_cache = (
        torch.randn(kv_heads, num_slots, kv_layout.width(head_dim, cache_dtype), generator=gen).mul(50).to(cache_dtype)
        for _ in range(2)
    )

    heads = qkv[:, : (q_heads + kv_heads) * head_dim].view(tokens, q_heads + kv_heads, head_dim)
    norms = (
        (torch.randn(head_dim, generator=gen), torch.randn(head_dim, generator=gen), 1e-6)
        if qk_norm
        else (None, None, 0.0)
    )
    if qk_norm:  # as RMSNorm's eager ops, query heads with q_norm and key heads with k_norm
        weights = torch.cat([norms[0].expand(q_heads, -1), norms[1].expand(kv_heads, -1)])
        heads = weights * F.rms_norm(heads, (head_dim,), eps=norms[2])
    rotated = apply_rotary(heads, (cos, sin))
    v = qkv[:, (q_heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    kv_layout.write(expected_k, expected_v, slots, rotated[:, q_heads:], v, block_size)
    expected_qkv = torch.cat([rotated.flatten(1), v.flatten(1)], dim=1)

    torch.ops.tokenloop.rotary_cache_write(
        qkv, cos.squeeze(1), sin.squeeze(1), k_cache, v_cache, slots, block_size, q_heads, *norms
    )
    same = (
        torch.equal
        if not qk_norm
        else lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-5 if a.dtype == torch.float32 else 2e-3)
    )
    assert same(qkv, expected_qkv)
    if cache_dtype == torch.int8 and qk_norm:  # the norm's last-bit differences may move a key to the next step
        got, want = (kv_layout.rows(k, v, block_size)[0] for k, v in ((k_cache, v_cache), (expected_k, expected_v)))
        torch.testing.assert_close(got, want, atol=0.05, rtol=0, equal_nan=True)
    else:
        assert same(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)


def test_bad_inputs_raise_a_clear_error():
    qkv, table = torch.randn(3, 4 * 16), torch.randn(3, 16)
    cache, slots = torch.zeros(1, 16, 16), torch.arange(3)
    with pytest.raises(RuntimeError, match="qkv must be"):
        torch.ops.tokenloop.rotary_cache_write(torch.randn(3, 5 * 16), table, table, cache, cache, slots, 16, 2)
    with pytest.raises(RuntimeError, match="cos and sin must be"):
        torch.ops.tokenloop.rotary_cache_write(qkv, table[:2], table, cache, cache, slots, 16, 2)
    with pytest.raises(RuntimeError, match="slot_mapping must be"):
        torch.ops.tokenloop.rotary_cache_write(qkv, table, table, cache, cache, slots[:2], 16, 2)
    with pytest.raises(RuntimeError, match="q_norm and k_norm come together"):
        torch.ops.tokenloop.rotary_cache_write(
            qkv, table, table, cache, cache, slots, 16, 2, torch.ones(16), None, 1e-6
        )
    with pytest.raises(RuntimeError, match="q_norm and k_norm must be"):
        torch.ops.tokenloop.rotary_cache_write(
            qkv, table, table, cache, cache, slots, 16, 2, torch.ones(8), torch.ones(8), 1e-6
        )
    with pytest.raises(RuntimeError, match="slot 16 is outside the cache's 16 slots"):
        torch.ops.tokenloop.rotary_cache_write(qkv, table, table, cache, cache, torch.tensor([0, 16, 1]), 16, 2)
