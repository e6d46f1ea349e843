"""Model runner: the only place tensors are built. Owns the KV cache, runs the forward pass, samples.

The KV cache is one preallocated pool per layer, [kv_heads, num_blocks * block_size, head_dim], written in place.
A token at position p of a sequence lives in slot block_table[p // block_size] * block_size + p % block_size.
Heads first: one head's rows of a block are contiguous, which is what decode attention reads (one KV head of
one sequence at a time).
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from tokenloop.engine.compiled_decode import CompileSpec, DecodeForward
from tokenloop.engine.scheduler import ScheduledBatch
from tokenloop.engine.sequence import Sequence
from tokenloop.models.attention import AttentionGroup, AttentionMetadata
from tokenloop.models.config import ModelConfig
from tokenloop.sampling.sampler import ProcessorInputs, Sampler, SamplerOutput, SamplingBatch


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * dtype.itemsize


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled KV pool. On the CPU it is an anonymous memory map, whose pages stay unmapped (and out of
    the resident memory) until a token is written there: a pool sized for the worst case costs what it holds.
    Not numpy's or torch's allocation: they ask the kernel for 2 MiB pages, so each first token written into
    a region would make 2 MiB resident (hundreds of MiB over 60 pools of 3 heads)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, math.prod(shape) * dtype.itemsize), dtype=torch.uint8).view(dtype).view(shape)


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

    @classmethod
    def concat(cls, parts: list[StepSamples]) -> StepSamples:
        """The rows of several samplings in order; rows of a part without logprobs get empty ones (they asked for none)."""
        with_logprobs = any(p.logprobs is not None for p in parts)

        def rows(name: str, p: StepSamples, empty) -> list:
            value = getattr(p, name)
            return value if value is not None else [empty] * len(p.token_ids)

        return cls(
            [t for p in parts for t in p.token_ids],
            [r for p in parts for r in rows("logprobs", p, [])] if with_logprobs else None,
            [r for p in parts for r in rows("logprob_token_ids", p, [])] if with_logprobs else None,
            [r for p in parts for r in rows("ranks", p, 0)] if with_logprobs else None,
        )


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
        background: CompileSpec | None = None,  # where compile: build a missing package in a child process
    ) -> None:
        self.model, self.config, self.block_size, self.device = model, config, block_size, device
        shape = (config.num_kv_heads, num_blocks * block_size, config.head_dim)
        layers = model.attention_layers()
        for attn in layers:
            attn.bind_cache(zeroed_pool(shape, kv_dtype, device), zeroed_pool(shape, kv_dtype, device))
        self.forward = DecodeForward(model, [attn.k_cache for attn in layers], [attn.v_cache for attn in layers], compile, background)
        self.sampler = Sampler()

    def prepare(self, batch: ScheduledBatch) -> ModelInput:
        # The index arrays are a few dozen integers: numpy builds them in about a microsecond an op, torch's
        # dispatch costs several, and a decode step takes ~10 ms. They reach the device once, at the end.
        bs = self.block_size
        starts_list = [seq.num_computed_tokens for seq in batch.seqs]
        input_ids = [t for seq, s, n in zip(batch.seqs, starts_list, batch.num_new_tokens) for t in seq.token_ids[s : s + n]]
        starts = np.array(starts_list, dtype=np.int64)  # [B]
        lens = np.array(batch.num_new_tokens, dtype=np.int64)  # [B]
        ends = lens.cumsum()
        max_blocks = max(len(seq.block_table) for seq in batch.seqs)
        block_tables = np.array([seq.block_table + [0] * (max_blocks - len(seq.block_table)) for seq in batch.seqs], dtype=np.int64)
        seq_of_token = np.repeat(np.arange(len(lens)), lens)  # [T]
        positions = np.arange(len(seq_of_token)) - (ends - lens)[seq_of_token] + starts[seq_of_token]  # [T]
        slot_mapping = block_tables[seq_of_token, positions // bs] * bs + positions % bs

        # Decodes (one new token) and prefill chunks attend in separate groups: padded to one [B, Q] batch, each
        # decode would be computed for as many query rows as the longest chunk has.
        decodes = lens == 1
        parts = [np.flatnonzero(decodes), np.flatnonzero(~decodes)] if decodes.any() and not decodes.all() else [np.arange(len(lens))]
        device = self.device
        groups = []
        for part in parts:
            group = self._attention_group(starts[part], lens[part], (ends - lens)[part], block_tables[part], whole_batch=len(parts) == 1)
            groups.append(AttentionGroup(*(None if a is None else _to_device(a, device) for a in group)))
        sample_seq_indices = [i for i, (seq, s, n) in enumerate(zip(batch.seqs, starts_list, batch.num_new_tokens)) if s + n == seq.num_tokens]
        return ModelInput(
            input_ids=_to_device(np.array(input_ids, dtype=np.int64), device),
            positions=_to_device(positions, device),
            meta=AttentionMetadata(_to_device(slot_mapping, device), groups),
            sample_rows=_to_device((ends - 1)[sample_seq_indices], device),
            sample_seq_indices=sample_seq_indices,
            # The compiled package takes contexts of two tokens or more: a one-token prompt's first step runs eager.
            decode_only=bool(decodes.all()) and int((starts + lens).max()) > 1,
        )

    def _attention_group(self, starts: np.ndarray, lens: np.ndarray, first_rows: np.ndarray, block_tables: np.ndarray, whole_batch: bool):
        """AttentionGroup's arrays for some sequences of the batch (all of them: `whole_batch`): their first
        computed positions, new-token counts, flat rows of their first new token, and block tables."""
        bs = self.block_size
        num_q, num_k = int(lens.max()), int((starts + lens).max())
        q_offsets = np.arange(num_q, dtype=np.int64)
        q_pos = starts[:, None] + q_offsets[None, :]  # [B, Q]
        q_valid = q_offsets[None, :] < lens[:, None]  # [B, Q]
        k_pos = np.arange(num_k, dtype=np.int64)
        key_slots = block_tables[:, k_pos // bs] * bs + k_pos % bs  # [B, K]; padding keys point at block 0
        mask = k_pos[None, None, :] <= q_pos[:, :, None]  # [B, Q, K] causal; padding queries still see key 0 (no NaN)
        if self.config.sliding_window is not None:
            mask &= k_pos[None, None, :] > q_pos[:, :, None] - self.config.sliding_window
        # One prompt from its first token: the mask is plain causal, which SDPA applies without reading a
        # mask and skipping the blocks above the diagonal (~40% less attention time in a long prefill).
        plain_causal = len(lens) == 1 and starts[0] == 0 and num_q > 1 and self.config.sliding_window is None
        query_index = np.where(q_valid, first_rows[:, None] + q_offsets[None, :], 0)
        return (
            query_index,
            np.flatnonzero(q_valid),
            key_slots,
            None if plain_causal else mask.reshape(len(lens), 1, num_q, num_k),
            None if whole_batch else query_index[q_valid],
        )

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[list[int], StepSamples | None]:
        """Run one step; returns the batch indices of the sequences that sampled, and their samples."""
        inp = self.prepare(batch)
        logits = self.logits(inp)
        if logits is None:
            return [], None
        return inp.sample_seq_indices, self.sample(logits, [batch.seqs[i] for i in inp.sample_seq_indices])

    @torch.inference_mode()
    def logits(self, inp: ModelInput) -> torch.Tensor | None:
        """The forward pass: float32 logits [S, V] of the sequences that sample this step (None if none does)."""
        hidden = self.forward(inp.input_ids, inp.positions, inp.meta, inp.decode_only)
        if not inp.sample_seq_indices:
            return None
        return self.model.compute_logits(hidden[inp.sample_rows]).float()

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> StepSamples:
        """One token per row of `logits`, row i by seqs[i]'s sampling parameters and generator."""
        params = [s.params for s in seqs]
        processors = ProcessorInputs(params, [s.token_ids for s in seqs], [s.controls for s in seqs])
        sampling = SamplingBatch.from_params(params, [s.generator for s in seqs], logits.shape[-1], logits.device, processors)
        return StepSamples.from_sampler(self.sampler(logits, sampling))
