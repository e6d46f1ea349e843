"""Model runner: the only place tensors are built. Owns the KV cache, runs the forward pass, samples.

The KV cache is preallocated pools, [kv_heads, num_blocks * block_size, width], written in place
(models/kv_layout.py: width is head_dim, or head_dim + 2 bytes in an int8 cache): pool i holds layer i of every
KV cache group (engine/kv_groups.py; a model with one group: pool i is layer i's), each group at its own blocks.
A token at position p of a sequence lives, for its layers of group g, in slot
block_tables[g][p // block_size] * block_size + p % block_size.
Heads first: one head's rows of a block are contiguous, which is what decode attention reads (one KV head of
one sequence at a time).
"""

from __future__ import annotations

import itertools
import math
import mmap
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from tokenloop.engine.compiled_decode import CompileSpec, DecodeForward
from tokenloop.engine.kv_groups import kv_cache_groups
from tokenloop.engine.scheduler import ScheduledBatch
from tokenloop.engine.sequence import Sequence
from tokenloop.engine.trace import record_steps, rng_states
from tokenloop.models import kv_layout
from tokenloop.models.attention import AttentionMetadata
from tokenloop.models.config import ModelConfig
from tokenloop.models.lora_layers import LoRABatch, LoRAContext
from tokenloop.sampling.sampler import ProcessorInputs, Sampler, SamplerOutput, SamplingBatch, gather_logprobs
from tokenloop.spec_decode.rejection_sampler import verify

SCORE_ROWS = 256  # logit rows log-softmaxed at once when scoring a sequence's own tokens


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
    """A step's samples as Python lists (one device-to-host copy per step): rows = new tokens, sequence after
    sequence; one per sequence that sampled, or `counts[i]` for sequence i when drafts were verified."""

    token_ids: list[int]
    logprobs: list[list[float]] | None  # per row: the chosen token's logprob, then the top K
    logprob_token_ids: list[list[int]] | None
    ranks: list[int] | None
    counts: list[int] | None = None  # new tokens per sequence (its accepted draft tokens and one more); None: one each

    @classmethod
    def from_sampler(cls, out: SamplerOutput, counts: list[int] | None = None) -> StepSamples:
        if out.logprobs is None:
            return cls(out.token_ids.tolist(), None, None, None, counts)
        return cls(
            out.token_ids.tolist(), out.logprobs.tolist(), out.logprob_token_ids.tolist(), out.ranks.tolist(), counts
        )

    def rows_of(self) -> list[range]:
        """Per sequence, its rows."""
        counts = self.counts if self.counts is not None else [1] * len(self.token_ids)
        starts = itertools.accumulate(counts, initial=0)
        return [range(start, start + c) for start, c in zip(starts, counts)]

    @classmethod
    def concat(cls, parts: list[StepSamples]) -> StepSamples:
        """The rows of several samplings in order; rows of a part without logprobs get empty ones (they asked for
        none)."""
        with_logprobs = any(p.logprobs is not None for p in parts)

        def rows(name: str, p: StepSamples, empty) -> list:
            value = getattr(p, name)
            return value if value is not None else [empty] * len(p.token_ids)

        return cls(
            [t for p in parts for t in p.token_ids],
            [r for p in parts for r in rows("logprobs", p, [])] if with_logprobs else None,
            [r for p in parts for r in rows("logprob_token_ids", p, [])] if with_logprobs else None,
            [r for p in parts for r in rows("ranks", p, 0)] if with_logprobs else None,
            [len(r) for p in parts for r in p.rows_of()] if any(p.counts is not None for p in parts) else None,
        )


@dataclass(slots=True)
class LogitSpan:
    """The rows of a step's logits that belong to one sequence: its positions
    [first_position, first_position + count)."""

    seq_index: int  # in the batch
    start: int  # its first row in the step's logits
    first_position: int
    count: int
    samples: bool  # its last rows are the ones it samples from (its prefill has caught up)
    num_draft: int = 0  # draft tokens it verifies: it samples from its last 1 + num_draft rows

    @property
    def num_sampling_rows(self) -> int:
        return self.samples * (1 + self.num_draft)

    @property
    def num_scored(self) -> int:
        """Rows that score its own next tokens (teacher forcing) rather than sample a new one."""
        return self.count - self.num_sampling_rows


@dataclass(slots=True)
class ModelInput:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    logit_rows: torch.Tensor  # [R] the flat rows whose logits the step computes, span after span
    spans: list[LogitSpan]  # per sequence that asks for logits, in batch order
    decode_only: bool  # one new token per sequence: the compiled step's case
    block_copies: list[tuple[int, int]]  # (source, destination) KV blocks copied before the forward pass
    lora: LoRABatch | None = None  # the rows of each adapter in the batch (None: every row is the base model's)
    # [H] the flat rows whose final hidden state (after the final norm: the LM head's input) the step returns, for a
    # drafter's features (ModelRunner.hidden_states: every new token's row, in order); None: none.
    hidden_rows: torch.Tensor | None = None

    @property
    def sample_spans(self) -> list[LogitSpan]:
        return [span for span in self.spans if span.samples]

    @property
    def sample_seq_indices(self) -> list[int]:
        """[S] which sequences of the batch sample this step."""
        return [span.seq_index for span in self.spans if span.samples]


@dataclass(slots=True)
class ForwardRows:
    """What a forward pass returns: float32 logits [R, V] of inp.logit_rows (None: no sequence asks for any) and
    the final hidden states [H, hidden] of inp.hidden_rows (None: none asked for)."""

    logits: torch.Tensor | None
    hidden: torch.Tensor | None


@dataclass(slots=True)
class PagedBatch:
    """Where the new tokens of B sequences sit in a paged KV cache: T rows, sequence b's `lens[b]` tokens from
    position starts[b] on, flattened in order. Any model over such a cache builds its step from it (the target's
    runner, an EAGLE head's own cache)."""

    meta: AttentionMetadata
    positions: torch.Tensor  # [T] on the device
    lens: np.ndarray  # [B] int64
    ends: np.ndarray  # [B] int64: one past each sequence's last row
    seq_of_token: np.ndarray  # [T] int64: the sequence each row belongs to

    @classmethod
    def of(
        cls,
        block_tables: list[list[list[int]]],
        starts: list[int],
        lens: list[int],
        block_size: int,
        device: torch.device,
    ) -> PagedBatch:
        """block_tables: per sequence, its table per KV cache group."""
        bs = block_size
        starts_np = np.array(starts, dtype=np.int64)  # [B]
        lens_np = np.array(lens, dtype=np.int64)  # [B]
        ends = lens_np.cumsum()
        max_blocks = max(len(table) for tables in block_tables for table in tables)
        # [G, B, max_blocks]; blocks given back (NULL_BLOCK) and padding → 0, never read
        tables = np.array(
            [[table + [0] * (max_blocks - len(table)) for table in tables] for tables in block_tables], dtype=np.int64
        ).transpose(1, 0, 2)
        tables = np.maximum(tables, 0)
        seq_of_token = np.repeat(np.arange(len(lens_np)), lens_np)  # [T]
        positions = np.arange(len(seq_of_token)) - (ends - lens_np)[seq_of_token] + starts_np[seq_of_token]  # [T]
        slot_mapping = tables[:, seq_of_token, positions // bs] * bs + positions % bs  # [G, T]
        meta = AttentionMetadata(
            _to_device(slot_mapping, device),
            _to_device(tables, device),
            _to_device(ends - lens_np, device),
            _to_device(lens_np, device),
            _to_device(starts_np, device),
            bs,
        )
        return cls(meta, _to_device(positions, device), lens_np, ends, seq_of_token)


@dataclass(slots=True)
class PromptScores:
    """Logprobs of a sequence's own tokens at positions [first_position, ...), each from the logits one position
    before it: rows of StepSamples whose token_ids are the scored tokens."""

    seq_index: int
    first_position: int
    samples: StepSamples


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
        lora: LoRAContext | None = None,  # the context of the model's LoRA-wrapped linears (engine/lora.py)
        pool: Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor] = zeroed_pool,  # makes each KV pool
    ) -> None:
        self.model, self.config, self.block_size, self.device = model, config, block_size, device
        self.lora = lora or LoRAContext()
        shape = (config.num_kv_heads, num_blocks * block_size, kv_layout.width(config.head_dim, kv_dtype))
        groups = kv_cache_groups(config)
        pools = [(pool(shape, kv_dtype, device), pool(shape, kv_dtype, device)) for _ in groups[0].layers]
        self.k_pools, self.v_pools = [k for k, _ in pools], [v for _, v in pools]
        layers = model.attention_layers()
        for g, group in enumerate(groups):
            for i, layer in enumerate(group.layers):
                layers[layer].bind_cache(*pools[i], group=g, pool=i)
        self.forward = DecodeForward(model, self.k_pools, self.v_pools, block_size, compile, background)
        self.sampler = Sampler()
        # Steps return every new token's final hidden state too (ModelInput.hidden_rows): a drafter's features.
        self.hidden_states = False

    def prepare(self, batch: ScheduledBatch) -> ModelInput:
        # The index arrays are a few dozen integers: numpy builds them faster than torch dispatches an op, which
        # adds up over a step's many small ops. They reach the device once, at the end.
        bs = self.block_size
        starts_list = [seq.num_computed_tokens for seq in batch.seqs]
        drafts = [len(seq.draft) if seq.draft is not None else 0 for seq in batch.seqs]
        input_ids = []
        for seq, s, n, d in zip(batch.seqs, starts_list, batch.num_new_tokens, drafts):
            input_ids += seq.token_ids[s : s + n]
            if d:  # the draft follows the sequence's last token
                input_ids += seq.draft.token_ids
        # Each sequence's new tokens (prompt chunk, last token, draft to verify) attend as one entry; the attention
        # kernel gives every query row the same floats whatever the entry's size, so how a sequence is scheduled
        # changes no token.
        device = self.device
        paged = PagedBatch.of([seq.block_tables for seq in batch.seqs], starts_list, batch.num_new_tokens, bs, device)
        lens, ends, seq_of_token = paged.lens, paged.ends, paged.seq_of_token
        spans, logit_rows = [], []
        for i, (seq, start, n, d, first_row) in enumerate(
            zip(batch.seqs, starts_list, batch.num_new_tokens, drafts, (ends - lens).tolist())
        ):
            # Position p's logits score token p + 1: a prompt being scored asks for the rows of its new prompt
            # positions; a sequence whose prefill has caught up asks for its last row, to sample from, and for
            # its draft's rows, to verify.
            num_scored = max(0, min(start + n, seq.num_prompt_tokens - 1) - start) if seq.score_prompt else 0
            samples = start + n == seq.num_tokens + d
            assert not (num_scored and samples) or num_scored == n - 1, (
                "a scored prompt runs up to the row that samples"
            )
            first, count = (start if num_scored else start + n - 1 - d), num_scored + samples * (1 + d)
            if count:
                spans.append(LogitSpan(i, len(logit_rows), first, count, samples, d if samples else 0))
                logit_rows.extend(range(first_row + first - start, first_row + first - start + count))
        return ModelInput(
            input_ids=_to_device(np.array(input_ids, dtype=np.int64), device),
            positions=paged.positions,
            meta=paged.meta,
            logit_rows=_to_device(np.array(logit_rows, dtype=np.int64), device),
            spans=spans,
            decode_only=bool((lens == 1 + np.array(drafts, dtype=np.int64)).all()),
            block_copies=batch.block_copies,
            lora=self._lora_batch(batch, seq_of_token),
            hidden_rows=_to_device(np.arange(len(seq_of_token)), device) if self.hidden_states else None,
        )

    def _lora_batch(self, batch: ScheduledBatch, seq_of_token: np.ndarray) -> LoRABatch | None:
        """Per adapter in the batch, the flat rows of its sequences' tokens."""
        slots = np.array([seq.lora.index if seq.lora is not None else -1 for seq in batch.seqs], dtype=np.int64)
        if (slots < 0).all():
            return None
        slot_of_token = slots[seq_of_token]  # [T]
        return LoRABatch(
            [
                (int(s), _to_device(np.flatnonzero(slot_of_token == s), self.device))
                for s in np.unique(slots[slots >= 0])
            ]
        )

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[list[int], StepSamples | None]:
        """Run one step; returns the batch indices of the sequences that sampled, and their samples."""
        inp = self.prepare(batch)
        logits = self.logits(inp)
        if logits is None or not inp.sample_spans:
            return [], None
        return inp.sample_seq_indices, self.sample(
            self.sample_logits(logits, inp), [batch.seqs[i] for i in inp.sample_seq_indices]
        )

    @torch.inference_mode()
    def logits(self, inp: ModelInput) -> torch.Tensor | None:
        """The forward pass: float32 logits [R, V] of the rows the sequences ask for (None if none does)."""
        return self.forward_rows(inp).logits

    @torch.inference_mode()
    def forward_rows(self, inp: ModelInput) -> ForwardRows:
        """The forward pass: the logits of inp.logit_rows and the final hidden states of inp.hidden_rows."""
        if inp.block_copies:
            self.copy_blocks(inp.block_copies)
        with self.lora.use(inp.lora):  # the compiled step is the base model's: adapters' rows run eager
            hidden = self.forward(inp.input_ids, inp.positions, inp.meta, inp.decode_only and inp.lora is None)
        rows = None if inp.hidden_rows is None else hidden[inp.hidden_rows]
        if not inp.spans:
            return ForwardRows(None, rows)
        return ForwardRows(self.model.compute_logits(hidden[inp.logit_rows]).float(), rows)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy on write: each destination block gets its source's K/V, in every layer, outside the compiled step
        (so eager and compiled steps stay alike). A destination is a new block, never a source in the same step;
        one freed and handed out again within the step gets its last copy."""
        bs = self.block_size
        last = {d: s for s, d in copies}
        src = torch.tensor([s * bs + i for s in last.values() for i in range(bs)], device=self.device)
        dst = torch.tensor([d * bs + i for d in last for i in range(bs)], device=self.device)
        for pool in self.k_pools + self.v_pools:  # [kv_heads, slots, width]
            pool[:, dst] = pool[:, src]

    @staticmethod
    def sample_logits(logits: torch.Tensor, inp: ModelInput) -> torch.Tensor:
        """The rows the sampling sequences sample from, sequence after sequence: one each, or 1 + its draft's
        length (all rows, when no sequence scores tokens)."""
        rows = [r for span in inp.sample_spans for r in range(span.start + span.num_scored, span.start + span.count)]
        if len(rows) == logits.shape[0]:
            return logits
        return logits[torch.tensor(rows, device=logits.device)]

    @torch.inference_mode()
    def score(self, logits: torch.Tensor, inp: ModelInput, seqs: list[Sequence]) -> list[PromptScores]:
        """Logprobs of the tokens each scoring row predicts (a prompt's own next tokens), with the top
        params.prompt_logprobs of each row's raw distribution."""
        scores = []
        for span in inp.spans:
            if not span.num_scored:
                continue
            seq = seqs[span.seq_index]
            positions = range(span.first_position + 1, span.first_position + 1 + span.num_scored)
            targets = torch.tensor([seq.token_ids[p] for p in positions], device=logits.device)
            parts = []
            for r in range(0, span.num_scored, SCORE_ROWS):  # log_softmax a slice at a time: no second [R, V] copy
                rows = slice(span.start + r, span.start + min(r + SCORE_ROWS, span.num_scored))
                out = gather_logprobs(
                    logits[rows].log_softmax(dim=-1), targets[r : r + SCORE_ROWS], seq.params.prompt_logprobs or 0
                )
                parts.append(StepSamples.from_sampler(out))
            scores.append(PromptScores(span.seq_index, positions.start, StepSamples.concat(parts)))
        return scores

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> StepSamples:
        """One token per row of `logits`, row i by seqs[i]'s sampling parameters and generator; where a sequence
        has a draft, its 1 + len(draft) rows are verified (spec_decode/rejection_sampler.py) and it gets 1 or more.
        Traced sequences (SamplingParams.trace) keep their rows (engine/trace.py)."""
        states = rng_states(seqs)
        if any(s.draft is not None for s in seqs):
            samples = StepSamples.from_sampler(*verify(logits, seqs, [s.params.logprobs for s in seqs]))
        else:
            params = [s.params for s in seqs]
            processors = ProcessorInputs(params, [s.token_ids for s in seqs], [s.controls for s in seqs])
            num_logprobs = [s.num_candidates if s.num_candidates is not None else s.params.logprobs for s in seqs]
            sampling = SamplingBatch.from_params(
                params, [s.generator for s in seqs], logits.shape[-1], logits.device, processors, num_logprobs
            )
            samples = StepSamples.from_sampler(self.sampler(logits, sampling))
        if states is not None:
            record_steps(seqs, logits, samples.counts, states)
        return samples
