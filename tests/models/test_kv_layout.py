"""The KV cache's block layout (models/kv_layout.py): an int8 cache quantizes each token's head by itself, so that a
block holds the same bytes however its tokens were written, and twice the tokens fit in the same memory."""

from __future__ import annotations

import pytest
import torch

from tokenloop import kernels
from tokenloop.engine.config import EngineConfig
from tokenloop.models import kv_layout
from tokenloop.models.config import ModelConfig
from tokenloop.models.layers import RotaryEmbedding


def test_quantize_rounds_each_head_to_int8_steps_of_its_own_scale():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 64, generator=gen) * torch.tensor([0.01, 1.0, 40.0]).view(1, 3, 1)
    x[2, 1] = 0.0
    q, scale = kv_layout.quantize(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float16 and scale.shape == (5, 3)
    assert q.abs().max() <= 127 and scale[2, 1] == 0 and not q[2, 1].any()
    error = (q.float() * scale.float().unsqueeze(-1) - x).abs()
    assert (error <= scale.float().unsqueeze(-1) * 0.5 + 1e-6).all()  # at most half a step, every value
    assert torch.equal(kv_layout.quantize(x[1:2, 2])[0], q[1:2, 2])  # a head's bytes are its own


@pytest.mark.parametrize("block_size", [16, 32])
def test_an_int8_block_filled_token_by_token_holds_the_bytes_of_one_filled_at_once(block_size):
    gen = torch.Generator().manual_seed(block_size)
    k, v = (torch.randn(40, 3, 64, generator=gen) * 5 for _ in range(2))
    slots = torch.randperm(4 * block_size, generator=gen)[:40]
    shape = (3, 4 * block_size, kv_layout.width(64, torch.int8))
    whole = tuple(torch.zeros(shape, dtype=torch.int8) for _ in range(2))
    kv_layout.write(*whole, slots, k, v, block_size)
    one_by_one = tuple(torch.zeros(shape, dtype=torch.int8) for _ in range(2))
    for t in range(40):
        kv_layout.write(*one_by_one, slots[t : t + 1], k[t : t + 1], v[t : t + 1], block_size)
    assert all(torch.equal(a, b) for a, b in zip(whole, one_by_one))
    keys, values = kv_layout.rows(*whole, block_size)
    assert keys.dtype == torch.float32 and keys.shape == (3, 4 * block_size, 64)
    torch.testing.assert_close(keys[:, slots].transpose(0, 1), k, atol=5 * 4 / 127, rtol=0)
    torch.testing.assert_close(values[:, slots].transpose(0, 1), v, atol=5 * 4 / 127, rtol=0)


@pytest.mark.skipif(kernels._unsupported_reason() is not None, reason=str(kernels._unsupported_reason()))
def test_the_kernels_chunked_writes_hold_the_bytes_of_the_python_write():
    """rotary_cache_write over a prompt in chunks of 1, 7 and all its tokens: the same int8 bytes and scales as
    kv_layout.write of the rotated keys at once."""
    assert kernels.cpu_kernels_available()
    gen = torch.Generator().manual_seed(1)
    tokens, q_heads, kv_heads, d, bs = 30, 9, 3, 64, 16
    cos, sin = (t.squeeze(1) for t in RotaryEmbedding(d, 256, 10000.0, None).tables(torch.arange(tokens)))
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * d, generator=gen) * 3
    slots = torch.randperm(3 * bs, generator=gen)[:tokens]
    shape = (kv_heads, 3 * bs, kv_layout.width(d, torch.int8))
    caches = {}
    for chunk in (1, 7, tokens):
        k_cache, v_cache = torch.zeros(shape, dtype=torch.int8), torch.zeros(shape, dtype=torch.int8)
        rows = qkv.clone()
        for a in range(0, tokens, chunk):
            part = rows[a : a + chunk].contiguous()
            torch.ops.tokenloop.rotary_cache_write(
                part, cos[a : a + chunk], sin[a : a + chunk], k_cache, v_cache, slots[a : a + chunk], bs, q_heads
            )
            rows[a : a + chunk] = part
        caches[chunk] = (k_cache, v_cache, rows)
    k_cache, v_cache, rotated = caches[tokens]
    expected = (torch.zeros(shape, dtype=torch.int8), torch.zeros(shape, dtype=torch.int8))
    keys = rotated[:, q_heads * d : (q_heads + kv_heads) * d].view(tokens, kv_heads, d)
    kv_layout.write(*expected, slots, keys, qkv[:, (q_heads + kv_heads) * d :].view(tokens, kv_heads, d), bs)
    for chunk, (k, v, _) in caches.items():
        assert torch.equal(k, expected[0]) and torch.equal(v, expected[1]), f"chunks of {chunk}"


def test_an_int8_cache_holds_about_twice_the_tokens_of_a_16_bit_one_in_the_same_memory():
    model = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=100,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=8192,
    )
    sixteen = EngineConfig(dtype="bfloat16", device="cpu").num_kv_blocks(model)
    int8 = EngineConfig(dtype="bfloat16", kv_cache_dtype="int8", device="cpu").num_kv_blocks(model)
    assert int8 / sixteen == pytest.approx(128 / 66, rel=1e-3)  # 64 bytes and a 2-byte scale against 128 bytes


def test_an_unknown_kv_cache_dtype_is_a_value_error_naming_the_field():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, got 'fp8'"):
        EngineConfig(kv_cache_dtype="fp8")
