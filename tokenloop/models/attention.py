"""Attention over the KV cache: write the new tokens' K/V into their slots, attend over each sequence's slots.

One rule covers prompt prefill, chunked prefill and decode: every forward carries some new tokens of
several sequences (flattened to T rows), and each sequence attends to all of its cached tokens, or, in a
sliding-window layer, to the last `window` of them (`AttentionMetadata.windowed`).

Training runs the same modules over whole sequences packed into one batch with no cache (`PackedSequences`): each
token attends to the tokens before it in its own sequence only (a block-causal mask), as teacher forcing scores
every position in one forward.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from tokenloop import kernels
from tokenloop.models import kv_layout


def gather(t: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """t indexed along `dim` by an index of any shape (t[index] for dim 0), by index_select: one contiguous copy per
    selected slice, where advanced indexing computes an offset per element (a 1,024-token prompt's queries in a
    sixth of the time)."""
    return t.index_select(dim, index.reshape(-1)).unflatten(dim, index.shape)


@dataclass(slots=True)
class AttentionMetadata:
    """Where a batch's new tokens sit in the KV cache and what they attend; built by the model runner, read by
    every layer. T new tokens of B sequences, flattened: sequence b's rows query_start[b] .. query_start[b] +
    query_count[b] - 1 are its positions first_position[b] onwards, and it attends to its positions 0 .. up to
    each query's own, position p of a layer of KV cache group g (engine/kv_groups.py) in slot
    block_tables[g][b][p // block_size] * block_size + p % block_size."""

    slot_mapping: torch.Tensor  # [G, T] int64: the cache slot each new token's K/V is written to, per group
    block_tables: torch.Tensor  # [G, B, max_blocks] int64 (padding, blocks outside a window → 0)
    query_start: torch.Tensor  # [B] int64
    query_count: torch.Tensor  # [B] int64
    first_position: torch.Tensor  # [B] int64
    block_size: int
    window: int | None = None  # set by windowed(): each query attends to its last `window` positions only

    def windowed(self, window: int) -> AttentionMetadata:
        """The batch as a sliding-window layer sees it: each query attends to the last `window` positions, its own
        included."""
        return replace(self, window=window)


@dataclass(slots=True)
class PackedSequences:
    """A training batch: whole sequences flattened into T rows, sequence b in rows starts[b] .. starts[b] +
    lengths[b] - 1 at positions 0 onwards; nothing is read from or written to a KV cache."""

    starts: torch.Tensor  # [B] int64
    lengths: torch.Tensor  # [B] int64
    window: int | None = None

    @classmethod
    def of(cls, lengths: list[int], device: torch.device | str = "cpu") -> PackedSequences:
        lengths_t = torch.tensor(lengths, dtype=torch.int64, device=device)
        return cls(torch.cumsum(lengths_t, 0) - lengths_t, lengths_t)

    def positions(self) -> torch.Tensor:
        """(T,) each row's position in its own sequence."""
        rows = torch.arange(int(self.lengths.sum()), device=self.lengths.device)
        return rows - torch.repeat_interleave(self.starts, self.lengths)

    def windowed(self, window: int) -> PackedSequences:
        return replace(self, window=window)


class KVCacheAttention(nn.Module):
    """Scaled dot-product attention whose keys and values live in one preallocated cache per layer."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale if scale is not None else head_dim**-0.5
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.kv_group = self.kv_pool = 0
        self.cpu_kernel = False

    def bind_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor, group: int = 0, pool: int = 0) -> None:
        """The model runner's pools, [num_kv_heads, num_slots, width] each in kv_layout's block layout, updated
        in place: pool `pool` of the runner's, which this layer writes at the blocks of KV cache group `group`.
        Their dtype may be narrower than the activations' (bfloat16 or float16 on the fast path, or int8 with a
        scale per token and head), converted on the way in and out. Attention reads them through
        tokenloop's CPU kernel where it can run, which gives each query row the same floats whatever else is in
        the call; elsewhere (a GPU) through SDPA over a gathered copy."""
        self.k_cache, self.v_cache, self.kv_group, self.kv_pool = k_cache, v_cache, group, pool
        self.cpu_kernel = k_cache.device.type == "cpu" and kernels.attention_kernel_supports(
            k_cache.dtype, self.head_dim
        )

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata | PackedSequences
    ) -> torch.Tensor:
        # q: (T, num_heads, head_dim); k, v: (T, num_kv_heads, head_dim)
        if isinstance(meta, PackedSequences):
            return self._packed(q, k, v, meta)
        kv_layout.write(self.k_cache, self.v_cache, meta.slot_mapping[self.kv_group], k, v, meta.block_size)
        return self.attend(q, meta)

    def attend(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention of the new tokens' queries (T, num_heads, head_dim), their K/V already in the cache:
        (T, hidden)."""
        if self.cpu_kernel and q.dtype == torch.float32:
            return torch.ops.tokenloop.paged_attention(
                q,
                self.k_cache,
                self.v_cache,
                meta.block_tables[self.kv_group],
                meta.block_size,
                meta.query_start,
                meta.query_count,
                meta.first_position,
                meta.window or 0,
                self.scale,
            )
        return self._sdpa(q, meta)

    def _sdpa(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The same attention through SDPA, where the kernel cannot run: the sequences padded to one [B, Q] batch of
        queries against a gathered [B, K] copy of their contexts, masked."""
        device, bs = q.device, meta.block_size
        num_q, num_k = int(meta.query_count.max()), int((meta.first_position + meta.query_count).max())
        offsets = torch.arange(num_q, device=device)
        valid = offsets[None, :] < meta.query_count[:, None]  # [B, Q]
        query_index = torch.where(valid, meta.query_start[:, None] + offsets, 0)  # [B, Q]
        q_pos = (meta.first_position[:, None] + offsets)[:, None, :, None]  # [B, 1, Q, 1]
        k_pos = torch.arange(num_k, device=device)
        mask = k_pos <= q_pos
        if meta.window is not None:
            mask = mask & (k_pos > q_pos - meta.window)
        # Padding queries keep key 0: no empty softmax row.
        mask = mask | (~mask.any(dim=-1, keepdim=True) & (k_pos == 0))
        kv_heads, slots, width = self.k_cache.shape
        tables = meta.block_tables[self.kv_group]
        # The sequences' whole blocks, then their rows: (B, num_kv_heads, K, head_dim).
        blocks = [
            gather(c.view(kv_heads, slots // bs, bs * width), 1, tables).view(kv_heads, -1, width)
            for c in (self.k_cache, self.v_cache)
        ]
        keys, values = (
            x.view(kv_heads, len(tables), -1, self.head_dim)[:, :, :num_k].to(q.dtype).transpose(0, 1)
            for x in kv_layout.rows(*blocks, bs)
        )
        queries = gather(q, 0, query_index).transpose(1, 2)  # (B, num_heads, Q, head_dim)
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads
        )
        out = out.transpose(1, 2).reshape(-1, self.num_heads * self.head_dim)  # (B * Q, hidden)
        return out.new_empty(q.shape[0], out.shape[1]).index_copy_(0, query_index[valid], out[valid.flatten()])

    def _packed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: PackedSequences) -> torch.Tensor:
        """Block-causal attention over packed whole sequences (training): each padded to the longest, [B, L]."""
        length = int(meta.lengths.max())
        offsets = torch.arange(length, device=q.device)
        valid = offsets[None, :] < meta.lengths[:, None]  # [B, L]
        index = torch.where(valid, meta.starts[:, None] + offsets, 0)  # [B, L]
        mask = offsets[None, :] <= offsets[:, None]  # [L(query), L(key)], causal
        if meta.window is not None:
            mask = mask & (offsets[None, :] > offsets[:, None] - meta.window)
        uniform = bool(valid.all())  # sequences of one length: the rows are the padded batch already (a view)
        queries, keys, values = (
            (t.view(len(index), length, *t.shape[1:]) if uniform else gather(t, 0, index)).transpose(1, 2)
            for t in (q, k, v)
        )  # (B, heads, L, head_dim)
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads
        )
        out = out.transpose(1, 2).reshape(-1, self.num_heads * self.head_dim)  # (B * L, hidden)
        return out if uniform else out[valid.flatten()]  # packed in order: the valid rows are the T rows'
