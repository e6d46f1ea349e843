"""Packing examples into rows (nothing attends across examples), the block-causal mask that keeps them apart, and
the deterministic order of rows in batches, so a resumed run finds its data position exactly."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenloop.train.data import Example

IGNORE_INDEX = -100  # a label not scored, as torch.nn.functional.cross_entropy ignores by default


@dataclass(frozen=True, slots=True)
class PackedRow:
    """Whole examples back to back. labels[i] is the target of position i (the next token of the same example when
    that token is scored, else IGNORE_INDEX); positions restart at 0 with each example."""

    token_ids: tuple[int, ...]
    labels: tuple[int, ...]
    positions: tuple[int, ...]
    seq_lens: tuple[int, ...]  # the examples' lengths, in order: the blocks of the block-causal mask
    lines: tuple[int, ...]  # the examples' JSONL lines, for logs

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        for name in ("labels", "positions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} must be as long as token_ids ({n}), got {len(getattr(self, name))}")
        if any(length < 1 for length in self.seq_lens) or sum(self.seq_lens) != n:
            raise ValueError(f"seq_lens must be positive and sum to len(token_ids) ({n}), got {self.seq_lens}")
        if len(self.lines) != len(self.seq_lens):
            raise ValueError(f"lines must name one line per example ({len(self.seq_lens)}), got {len(self.lines)}")

    @property
    def num_scored(self) -> int:
        """Targets in the row: the tokens whose loss counts (eval loss is their token-weighted mean NLL)."""
        return sum(label != IGNORE_INDEX for label in self.labels)


def example_labels(example: Example) -> list[int]:
    """Position i's target: token i + 1 when it is scored; the last position predicts nothing within the example."""
    ids, scored = example.token_ids, example.scored
    return [ids[i + 1] if scored[i + 1] else IGNORE_INDEX for i in range(len(ids) - 1)] + [IGNORE_INDEX]


def pack(examples: Sequence[Example], row_len: int) -> list[PackedRow]:
    """Examples in order, greedily: a new row starts when the next example does not fit in the current one. An
    example is never split, so every target is predicted from its whole example."""
    if row_len < 2:
        raise ValueError(f"row_len must be >= 2, got {row_len}")
    groups: list[list[Example]] = []
    used = row_len  # forces a first row
    for example in examples:
        if len(example.token_ids) > row_len:
            raise ValueError(f"line {example.line}: {len(example.token_ids)} tokens, more than a row of {row_len}")
        if used + len(example.token_ids) > row_len:
            groups.append([])
            used = 0
        groups[-1].append(example)
        used += len(example.token_ids)
    return [_row(group) for group in groups]


def _row(examples: list[Example]) -> PackedRow:
    token_ids, labels, positions = [], [], []
    for example in examples:
        token_ids += example.token_ids
        labels += example_labels(example)
        positions += range(len(example.token_ids))
    return PackedRow(
        token_ids=tuple(token_ids),
        labels=tuple(labels),
        positions=tuple(positions),
        seq_lens=tuple(len(e.token_ids) for e in examples),
        lines=tuple(e.line for e in examples),
    )


def block_causal_mask(seq_lens: Sequence[int]) -> torch.Tensor:
    """(T, T) bool, True where query i may attend to key j: j <= i within the same example. The reference the
    training forward's attention is tested against."""
    if any(length < 1 for length in seq_lens):
        raise ValueError(f"seq_lens must be positive, got {list(seq_lens)}")
    example = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(seq_lens, dtype=torch.long))  # (T,)
    total = example.numel()
    causal = torch.ones(total, total, dtype=torch.bool).tril()
    return causal & (example[:, None] == example[None, :])


def batches(rows: Sequence[PackedRow], batch_size: int, seed: int, epoch: int) -> list[list[PackedRow]]:
    """One epoch's batches: the rows shuffled by (seed, epoch) alone, then cut in order (the last batch may be
    short). A run resumed at step k of an epoch takes batches(...)[k:] and sees exactly the data it would have."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if seed < 0 or epoch < 0:
        raise ValueError(f"seed and epoch must be >= 0, got seed={seed}, epoch={epoch}")
    # A string seed goes through SHA-512 (random.seed, version 2): the same order in every process and Python run.
    order = list(range(len(rows)))
    random.Random(f"tokenloop.train {seed} {epoch}").shuffle(order)
    return [[rows[i] for i in order[start : start + batch_size]] for start in range(0, len(order), batch_size)]


def num_scored_tokens(rows: Sequence[PackedRow]) -> int:
    """Targets over rows: the denominator of a token-weighted mean loss."""
    return sum(row.num_scored for row in rows)
