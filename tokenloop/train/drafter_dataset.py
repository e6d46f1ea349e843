"""A drafter's training data: conversations' token ids and the target's last hidden states, packed back to back,
the draft vocabulary, saved to and loaded from a folder; batches in EAGLE-1's layout.

Conversation c holds tokens x_0 .. x_{L-1} and hidden states h_0 .. h_{L-1} (h_t: the target's final-norm output
at t, from which it predicts x_{t+1}). The head's row t (t = 0 .. L-2) reads [embedding of x_{t+1}, h_t] and is
trained towards h_{t+1} (feature regression) and x_{t+2} (cross-entropy over the draft vocabulary; none for t = L-2).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tokenloop.models.attention import PackedSequences
from tokenloop.train.packing import IGNORE_INDEX

TENSORS = "data.safetensors"
META = "meta.json"


@dataclass(slots=True)
class DrafterBatch:
    """Conversations' rows packed into one flat batch of T rows; meta keeps each conversation to itself."""

    input_ids: torch.Tensor  # (T,) int64: x_{t+1}, whose embedding the head looks up
    hidden: torch.Tensor  # (T, d) float32: h_t
    target_hidden: torch.Tensor  # (T, d) float32: h_{t+1}
    target_draft: torch.Tensor  # (T,) int64: x_{t+2} as a draft-vocabulary index; IGNORE_INDEX outside it or none
    answer: torch.Tensor  # (T,) bool: rows serving drafts from (t >= answer_start - 1: x_{t+1} is an answer token)
    meta: PackedSequences  # lengths L - 1 per conversation, positions 0 onwards

    @property
    def num_rows(self) -> int:
        return len(self.input_ids)


@dataclass(slots=True)
class DrafterData:
    """C conversations back to back: N tokens in all, conversation c in rows offsets[c] .. offsets[c] + lengths[c]."""

    token_ids: torch.Tensor  # (N,) int32
    hidden: torch.Tensor  # (N, d) float16, bfloat16 or float32
    lengths: torch.Tensor  # (C,) int64, each >= 2
    answer_starts: torch.Tensor  # (C,) int64: the first answer token's index within its conversation
    draft_vocab: torch.Tensor  # (V,) int64, ascending target ids: draft index -> target id (EAGLE-3's d2t)
    vocab_size: int  # the target's
    info: dict[str, Any] = field(default_factory=dict)  # provenance and figures, saved as JSON
    offsets: torch.Tensor = field(init=False)  # (C,) int64

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if self.hidden.dim() != 2 or len(self.hidden) != n:
            raise ValueError(f"hidden must be (N={n}, d), got {tuple(self.hidden.shape)}")
        if len(self.answer_starts) != len(self.lengths):
            raise ValueError(f"answer_starts must hold one index per conversation ({len(self.lengths)})")
        if bool((self.lengths < 2).any()) or int(self.lengths.sum()) != n:
            raise ValueError(f"lengths must be >= 2 and sum to the number of tokens ({n})")
        if bool(((self.answer_starts < 1) | (self.answer_starts >= self.lengths)).any()):
            raise ValueError("answer_starts must lie in 1 .. length - 1 of each conversation")
        if len(self.draft_vocab) == 0 or bool((self.draft_vocab.diff() <= 0).any()):
            raise ValueError("draft_vocab must be non-empty and strictly ascending")
        if int(self.draft_vocab[-1]) >= self.vocab_size or int(self.draft_vocab[0]) < 0:
            raise ValueError(f"draft_vocab must hold target ids in 0 .. {self.vocab_size - 1}")
        self.offsets = torch.cumsum(self.lengths, 0) - self.lengths

    @property
    def num_conversations(self) -> int:
        return len(self.lengths)

    @property
    def num_answer_tokens(self) -> int:
        return int((self.lengths - self.answer_starts).sum())

    def conversation(self, c: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Conversation c's token ids (L,), hidden states (L, d) and answer start."""
        rows = slice(int(self.offsets[c]), int(self.offsets[c] + self.lengths[c]))
        return self.token_ids[rows], self.hidden[rows], int(self.answer_starts[c])

    def target_to_draft(self) -> torch.Tensor:
        """(vocab_size,) int64: each target id's draft index, IGNORE_INDEX outside the draft vocabulary (t2d)."""
        t2d = torch.full((self.vocab_size,), IGNORE_INDEX, dtype=torch.int64)
        t2d[self.draft_vocab] = torch.arange(len(self.draft_vocab))
        return t2d

    def batches(self, max_rows: int, seed: int, epoch: int) -> list[list[int]]:
        """One epoch's batches of conversation indices: shuffled by (seed, epoch) alone, then packed greedily up to
        max_rows head rows (L - 1 per conversation); a longer conversation makes a batch of its own."""
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        if seed < 0 or epoch < 0:
            raise ValueError(f"seed and epoch must be >= 0, got seed={seed}, epoch={epoch}")
        order = list(range(self.num_conversations))
        random.Random(f"tokenloop.drafter {seed} {epoch}").shuffle(order)
        groups: list[list[int]] = []
        used = max_rows  # forces a first batch
        for c in order:
            rows = int(self.lengths[c]) - 1
            if used + rows > max_rows:
                groups.append([])
                used = 0
            groups[-1].append(c)
            used += rows
        return groups

    def batch(self, conversations: list[int], device: torch.device | str = "cpu") -> DrafterBatch:
        """The head's rows of these conversations, in this order."""
        t2d = self.target_to_draft()
        parts: list[tuple[torch.Tensor, ...]] = []
        for c in conversations:
            ids, hidden, answer_start = self.conversation(c)
            ids = ids.long()
            next_next = torch.cat([t2d[ids[2:]], torch.tensor([IGNORE_INDEX])])  # (L - 1,): x_{t+2}, none at L - 2
            answer = torch.arange(len(ids) - 1) >= answer_start - 1
            parts.append((ids[1:], hidden[:-1], hidden[1:], next_next, answer))
        input_ids, hidden, target_hidden, target_draft, answer = (torch.cat(p) for p in zip(*parts))
        return DrafterBatch(
            input_ids.to(device),
            hidden.to(device, torch.float32),
            target_hidden.to(device, torch.float32),
            target_draft.to(device),
            answer.to(device),
            PackedSequences.of([int(self.lengths[c]) - 1 for c in conversations], device),
        )

    def save(self, folder: str | Path) -> Path:
        """data.safetensors (the tensors) and meta.json (vocab_size, info) in folder; returns the folder."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {
            "token_ids": self.token_ids,
            "hidden": self.hidden,
            "lengths": self.lengths,
            "answer_starts": self.answer_starts,
            "draft_vocab": self.draft_vocab,
        }
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / TENSORS))
        (folder / META).write_text(json.dumps({"vocab_size": self.vocab_size, "info": self.info}, indent=1) + "\n")
        return folder

    @classmethod
    def load(cls, folder: str | Path) -> DrafterData:
        folder = Path(folder)
        for name in (TENSORS, META):
            if not (folder / name).is_file():
                raise ValueError(f"{folder} holds no {name}: not a folder of drafter data")
        tensors = load_file(str(folder / TENSORS))
        meta = json.loads((folder / META).read_text())
        return cls(**tensors, vocab_size=meta["vocab_size"], info=meta["info"])
