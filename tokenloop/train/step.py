"""One training forward: packed rows through the serving model's own modules, the loss of their scored tokens.

Teacher forcing: every position is scored against its true next token in one forward, the block-causal mask
(PackedSequences) keeping each example to itself; the same model decoding the sequence token by token through
the paged KV cache gives the same logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tokenloop.models.attention import PackedSequences
from tokenloop.train.packing import IGNORE_INDEX, PackedRow


@dataclass(slots=True)
class Batch:
    """Rows packed into one flat batch of T tokens."""

    token_ids: torch.Tensor  # (T,) int64
    labels: torch.Tensor  # (T,) int64: the next token where scored, else IGNORE_INDEX
    meta: PackedSequences

    @classmethod
    def of(cls, rows: list[PackedRow], device: torch.device | str = "cpu") -> Batch:
        ids = [t for row in rows for t in row.token_ids]
        labels = [t for row in rows for t in row.labels]
        lengths = [n for row in rows for n in row.seq_lens]
        return cls(
            torch.tensor(ids, dtype=torch.int64, device=device),
            torch.tensor(labels, dtype=torch.int64, device=device),
            PackedSequences.of(lengths, device),
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_scored(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())


def summed_nll(model: nn.Module, batch: Batch) -> torch.Tensor:
    """The sum of the scored tokens' negative log-likelihoods (a scalar); logits only for the scored rows."""
    hidden = model(batch.token_ids, batch.meta.positions(), batch.meta)  # (T, hidden)
    scored = batch.labels != IGNORE_INDEX
    logits = model.compute_logits(hidden[scored]).float()  # (N, vocab)
    return F.cross_entropy(logits, batch.labels[scored], reduction="sum")


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[list[PackedRow]]) -> float:
    """Token-weighted mean negative log-likelihood of every scored token."""
    total, count = 0.0, 0
    for rows in batches:
        batch = Batch.of(rows)
        total += float(summed_nll(model, batch))
        count += batch.num_scored
    return total / count if count else math.nan


def learning_rate(step: int, total_steps: int, warmup_steps: int, min_ratio: float) -> float:
    """The multiplier of the base learning rate for `step` (0-based): linear warm-up, then cosine decay."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
