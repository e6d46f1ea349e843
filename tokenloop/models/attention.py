"""Attention over the KV cache: write the new tokens' K/V into their slots, attend over each sequence's slots.

One rule covers prompt prefill, chunked prefill and decode: every forward carries some new tokens of
several sequences (flattened to T rows), and each sequence attends to all of its cached tokens, or, in a
sliding-window layer, to the last `window` of them (`AttentionMetadata.windowed`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tokenloop import kernels


def gather(t: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """t indexed along `dim` by an index of any shape (t[index] for dim 0), by index_select: one contiguous copy per
    selected slice, where advanced indexing computes an offset per element (a 1,024-token prompt's queries in a
    sixth of the time)."""
    return t.index_select(dim, index.reshape(-1)).unflatten(dim, index.shape)


@dataclass(slots=True)
class AttentionGroup:
    """Sequences of a batch that attend together, padded to one [B, Q] batch of queries: B sequences, Q = most
    new tokens of one, K = longest context."""

    query_index: torch.Tensor  # [B, Q] int64: flat row of each sequence's new tokens (padding → 0)
    output_index: torch.Tensor  # [T_g] int64: position of each of the group's tokens in the padded [B * Q] output
    key_slots: torch.Tensor  # [B, K] int64: cache slots of each sequence's context, in position order (padding → 0)
    # [B, 1, Q, K] bool: True where a query may attend a key (causal, in-context, in-window); None when the
    # group is one sequence from position 0 (Q = K), whose mask is plain causal.
    mask: torch.Tensor | None
    token_rows: torch.Tensor | None  # [T_g] int64: flat rows of the group's tokens, in order; None: all T rows
    window: int | None = None  # set by windowed(): the mask keeps only the last `window` positions

    def windowed(self, window: int, positions: torch.Tensor) -> AttentionGroup:
        """The group as a layer sees it that attends to the last `window` positions only, the query's own
        included. Key j of a sequence is its position j (key_slots are in position order); the queries'
        positions come from the batch's (T,) positions."""
        q_pos = positions[self.query_index][:, None, :, None]  # (B, 1, Q, 1)
        k_pos = torch.arange(self.key_slots.shape[1], device=q_pos.device)  # (K,)
        causal = self.mask if self.mask is not None else k_pos <= q_pos
        mask = causal & (k_pos > q_pos - window)  # (B, 1, Q, K)
        # A padding query (its row is dropped) may find no key left in its window: it keeps key 0, so that
        # no row of the softmax is empty (NaN).
        mask = mask | (~mask.any(dim=-1, keepdim=True) & (k_pos == 0))
        return AttentionGroup(self.query_index, self.output_index, self.key_slots, mask, self.token_rows, window)


@dataclass(slots=True)
class AttentionMetadata:
    """Where a batch's new tokens sit in the KV cache and what they attend; built by the model runner, read
    by every layer. T new tokens of several sequences, flattened."""

    slot_mapping: torch.Tensor  # [T] int64: the cache slot each new token's K/V is written to
    # One group; in a step that mixes decodes with prefill chunks, the decodes then the chunks.
    groups: list[AttentionGroup]

    def windowed(self, window: int, positions: torch.Tensor) -> AttentionMetadata:
        """The batch as a sliding-window layer sees it (AttentionGroup.windowed); computed once per forward."""
        return AttentionMetadata(self.slot_mapping, [group.windowed(window, positions) for group in self.groups])


class KVCacheAttention(nn.Module):
    """Scaled dot-product attention whose keys and values live in one preallocated cache per layer."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale if scale is not None else head_dim**-0.5
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.cpu_kernel = False
        self.prefill_kernel = False

    def bind_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """The model runner's pools, [num_kv_heads, num_slots, head_dim] each, updated in place. Their dtype may
        be narrower than the activations' (float16 on the fast path), converted on the way in and out. Decode
        reads them through tokenloop's CPU kernel where it can run, instead of gathering a dense copy; so does a
        fast-path prefill where the CPU has bfloat16 products (the float32 path keeps SDPA's float32 products)."""
        self.k_cache, self.v_cache = k_cache, v_cache
        self.cpu_kernel = (k_cache.device.type == "cpu" and self.head_dim % 8 == 0 and k_cache.dtype in (torch.float16, torch.float32)
                           and kernels.cpu_kernels_available())
        self.prefill_kernel = (self.cpu_kernel and k_cache.dtype == torch.float16 and self.head_dim % 64 == 0
                               and kernels.prefill_attention_available())

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # q: (T, num_heads, head_dim); k, v: (T, num_kv_heads, head_dim)
        self.k_cache.index_copy_(1, meta.slot_mapping, k.transpose(0, 1).to(self.k_cache.dtype))
        self.v_cache.index_copy_(1, meta.slot_mapping, v.transpose(0, 1).to(self.v_cache.dtype))
        return self.attend(q, meta)

    def attend(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention of the new tokens' queries (T, num_heads, head_dim), their K/V already in the cache."""
        if len(meta.groups) == 1:
            return self._attend(q, meta.groups[0])
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        for group in meta.groups:
            out.index_copy_(0, group.token_rows, self._attend(q, group))
        return out

    def _attend(self, q: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
        """The group's tokens' attention outputs, (T_g, hidden), in the order of their flat rows."""
        if self.cpu_kernel and group.mask is not None and group.query_index.shape[1] == 1:  # decodes: one query each
            rows = q if group.token_rows is None else q[group.token_rows]
            mask = group.mask.view(group.key_slots.shape)
            out = torch.ops.tokenloop.paged_decode_attention(rows.float().contiguous(), self.k_cache, self.v_cache, group.key_slots, mask, self.scale)
            return out.view(rows.shape[0], -1).to(q.dtype)
        if self.prefill_kernel and group.query_index.shape[0] == 1 and q.dtype == torch.float32:  # one sequence's new tokens
            rows = q if group.token_rows is None else q.index_select(0, group.token_rows)
            first = group.key_slots.shape[1] - rows.shape[0]  # the chunk's first position: key j is position j
            return torch.ops.tokenloop.prefill_attention(rows, self.k_cache, self.v_cache, group.key_slots[0], first, group.window or 0, self.scale)
        keys = gather(self.k_cache, 1, group.key_slots).to(q.dtype).transpose(0, 1)  # (B, num_kv_heads, K, head_dim)
        values = gather(self.v_cache, 1, group.key_slots).to(q.dtype).transpose(0, 1)
        queries = gather(q, 0, group.query_index).transpose(1, 2)  # (B, num_heads, Q, head_dim)
        num_q, num_k = queries.shape[2], keys.shape[2]
        if group.window is not None and queries.shape[0] == 1 and num_q > group.window:
            # One sequence's long chunk in a sliding-window layer. SDPA computes every block of the [Q, K] scores
            # it is given, masked or not: pieces of `step` queries, each over the window + step - 1 keys its
            # window reaches, compute (window + step) / window times the scores needed. Pieces of 64 in a
            # 512-token window: 1.12 (256: 1.5), 14% less SDPA time on a 1,024-token Gemma 3 prompt.
            step = max(min(group.window // 2, 64), 1)
            first = num_k - num_q  # the chunk's first position: key j is position j
            parts = []
            for a in range(0, num_q, step):
                b = min(a + step, num_q)
                k0, k1 = max(first + a - group.window + 1, 0), first + b
                parts.append(self._sdpa(queries[:, :, a:b], keys[:, :, k0:k1], values[:, :, k0:k1], group.mask[:, :, a:b, k0:k1]))
            out = torch.cat(parts, dim=2)
        else:
            out = self._sdpa(queries, keys, values, group.mask)  # (B, num_heads, Q, head_dim)
        out = out.transpose(1, 2).reshape(-1, self.num_heads * self.head_dim)  # (B * Q, hidden)
        return out.index_select(0, group.output_index)  # (T_g, hidden)

    def _sdpa(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads,
        )
