"""Model runner: the only place tensors are built. Owns the KV cache, runs the forward pass, samples.

The KV cache is one preallocated pool per layer, [num_blocks * block_size, kv_heads, head_dim], written in place.
A token at position p of a sequence lives in slot block_table[p // block_size] * block_size + p % block_size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from tokenloop.engine.compiled_decode import DecodeForward
from tokenloop.engine.scheduler import ScheduledBatch
from tokenloop.models.attention import AttentionMetadata
from tokenloop.models.config import ModelConfig
from tokenloop.sampling.sampler import Sampler, SamplerOutput, SamplingBatch


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * dtype.itemsize


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled KV pool. On the CPU it comes from calloc, whose pages stay unmapped (and out of the
    resident memory) until a token is written there: a pool sized for the worst case costs what it holds."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.from_numpy(np.zeros(math.prod(shape) * dtype.itemsize, dtype=np.uint8)).view(dtype).view(shape)


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(device)


@dataclass(slots=True)
class StepSamples:
    """A step's samples as Python lists (one device-to-host copy per step), rows = sequences that sampled."""

    token_ids: list[int]
    logprobs: list[list[float]] | None  # per row: the chosen token's logprob, then the top K
    logprob_token_ids: list[list[int]] | None
    ranks: list[int] | None

    @classmethod
    def from_sampler(cls, out: SamplerOutput) -> StepSamples:
        if out.logprobs is None:
            return cls(out.token_ids.tolist(), None, None, None)
        return cls(out.token_ids.tolist(), out.logprobs.tolist(), out.logprob_token_ids.tolist(), out.ranks.tolist())


@dataclass(slots=True)
class ModelInput:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [S] flat row of the last token of each sequence that samples this step
    sample_seq_indices: list[int]  # [S] which sequences of the batch sample (their prefill has caught up)
    decode_only: bool  # one new token per sequence: the compiled step's case


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype,
        device: torch.device,
        compile: bool = False,
    ) -> None:
        self.model, self.config, self.block_size, self.device = model, config, block_size, device
        shape = (num_blocks * block_size, config.num_kv_heads, config.head_dim)
        layers = model.attention_layers()
        for attn in layers:
            attn.bind_cache(zeroed_pool(shape, kv_dtype, device), zeroed_pool(shape, kv_dtype, device))
        self.forward = DecodeForward(model, [attn.k_cache for attn in layers], [attn.v_cache for attn in layers], compile)
        self.sampler = Sampler()

    def prepare(self, batch: ScheduledBatch) -> ModelInput:
        # The index arrays are a few dozen integers: numpy builds them in about a microsecond an op, torch's
        # dispatch costs several, and a decode step takes ~10 ms. They reach the device once, at the end.
        bs = self.block_size
        starts_list = [seq.num_computed_tokens for seq in batch.seqs]
        input_ids = [t for seq, s, n in zip(batch.seqs, starts_list, batch.num_new_tokens) for t in seq.token_ids[s : s + n]]
        starts = np.array(starts_list, dtype=np.int64)  # [B]
        lens = np.array(batch.num_new_tokens, dtype=np.int64)  # [B]
        num_q, num_k = int(lens.max()), int((starts + lens).max())
        max_blocks = max(len(seq.block_table) for seq in batch.seqs)
        block_tables = np.array([seq.block_table + [0] * (max_blocks - len(seq.block_table)) for seq in batch.seqs], dtype=np.int64)

        q_offsets = np.arange(num_q, dtype=np.int64)
        q_pos = starts[:, None] + q_offsets[None, :]  # [B, Q]
        q_valid = q_offsets[None, :] < lens[:, None]  # [B, Q]
        k_pos = np.arange(num_k, dtype=np.int64)
        key_slots = block_tables[:, k_pos // bs] * bs + k_pos % bs  # [B, K]; padding keys point at block 0
        mask = k_pos[None, None, :] <= q_pos[:, :, None]  # [B, Q, K] causal; padding queries still see key 0 (no NaN)
        if self.config.sliding_window is not None:
            mask &= k_pos[None, None, :] > q_pos[:, :, None] - self.config.sliding_window
        ends = lens.cumsum()
        # One prompt from its first token: the mask is plain causal, which SDPA applies without reading a
        # mask and skipping the blocks above the diagonal (~40% less attention time in a long prefill).
        plain_causal = len(batch.seqs) == 1 and starts_list[0] == 0 and num_q > 1 and self.config.sliding_window is None
        query_index = np.where(q_valid, (ends - lens)[:, None] + q_offsets[None, :], 0)
        slot_mapping = np.take_along_axis(key_slots, np.minimum(q_pos, num_k - 1), axis=1)[q_valid]
        device = self.device
        meta = AttentionMetadata(
            slot_mapping=_to_device(slot_mapping, device),
            query_index=_to_device(query_index, device),
            output_index=_to_device(np.flatnonzero(q_valid), device),
            key_slots=_to_device(key_slots, device),
            mask=None if plain_causal else _to_device(mask.reshape(len(batch.seqs), 1, num_q, num_k), device),
        )
        sample_seq_indices = [i for i, (seq, s, n) in enumerate(zip(batch.seqs, starts_list, batch.num_new_tokens)) if s + n == seq.num_tokens]
        return ModelInput(
            input_ids=_to_device(np.array(input_ids, dtype=np.int64), device),
            positions=_to_device(q_pos[q_valid], device),
            meta=meta,
            sample_rows=_to_device((ends - 1)[sample_seq_indices], device),
            sample_seq_indices=sample_seq_indices,
            # A one-token prompt's first step has a context of 1, a size dynamo would specialize on: eager.
            decode_only=num_q == 1 and num_k > 1,
        )

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[list[int], StepSamples | None]:
        """Run one step; returns the batch indices of the sequences that sampled, and their samples."""
        inp = self.prepare(batch)
        hidden = self.forward(inp.input_ids, inp.positions, inp.meta, inp.decode_only)
        if not inp.sample_seq_indices:
            return [], None
        logits = self.model.compute_logits(hidden[inp.sample_rows]).float()
        seqs = [batch.seqs[i] for i in inp.sample_seq_indices]
        sampling = SamplingBatch.from_params(
            [s.params for s in seqs], [s.generator for s in seqs], logits.shape[-1], logits.device
        )
        return inp.sample_seq_indices, StepSamples.from_sampler(self.sampler(logits, sampling))
