"""Training's attention over packed sequences: each token attends to the tokens before it in its own sequence only
(the block-causal mask), in a sliding window where the layer has one; sequences of one length or of several."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenloop.models.attention import KVCacheAttention, PackedSequences
from tokenloop.train.packing import block_causal_mask


@pytest.mark.parametrize("lengths", [[5, 1, 9, 3], [6, 6, 6], [11]])
@pytest.mark.parametrize("window", [None, 4])
def test_packed_attention_is_block_causal(lengths, window):
    heads, kv_heads, dim, total = 4, 2, 8, sum(lengths)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(total, n, dim, generator=generator) for n in (heads, kv_heads, kv_heads))
    meta = PackedSequences.of(lengths)
    if window is not None:
        meta = meta.windowed(window)
    out = KVCacheAttention(heads, kv_heads, dim)(q, k, v, meta)

    mask = block_causal_mask(lengths)
    if window is not None:
        positions = meta.positions()
        mask = mask & (positions[None, :] > positions[:, None] - window)
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(2, 1).transpose(0, 1),
        v.repeat_interleave(2, 1).transpose(0, 1),
        attn_mask=mask,
    )
    torch.testing.assert_close(out, expected.transpose(0, 1).reshape(total, heads * dim), atol=1e-6, rtol=1e-5)
    assert meta.positions().tolist() == [p for n in lengths for p in range(n)]
