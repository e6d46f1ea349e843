"""Sequence: the plain-Python state of one request as the engine sees it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tokenloop.sampling.params import SamplingParams
from tokenloop.sampling.processors import LogitControls

if TYPE_CHECKING:
    from tokenloop.engine.lora import LoRASlot
    from tokenloop.engine.trace import TraceStep
    from tokenloop.spec_decode.proposer import Draft


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class Sequence:
    seq_id: str  # "<request id>/<completion index>"
    token_ids: list[int]  # prompt followed by the generated tokens
    num_prompt_tokens: int
    params: SamplingParams
    generator: torch.Generator | None = None  # per-request RNG when params.seed is set
    status: SequenceStatus = SequenceStatus.WAITING
    # Tokens whose K/V are in the cache. It catches up with len(token_ids): one rule for prefill,
    # chunked prefill and prefix-cache hits. The newest sampled token is never computed yet.
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # how many prompt tokens came from the prefix cache
    # Per KV cache group (engine/kv_groups.py), its blocks in position order (a sliding group's blocks before its
    # window given back: NULL_BLOCK); empty while it holds none.
    block_tables: list[list[int]] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chain hashes of its leading full, computed blocks
    finish_reason: str | None = None  # "stop" or "length"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    controls: LogitControls | None = None  # the logits processors' state, when its request uses any
    # Its prompt tokens get logprobs (completion 0 of a request with prompt_logprobs): every prompt position is
    # computed, none taken from the prefix cache. Cleared once the whole prompt is scored.
    score_prompt: bool = False
    num_candidates: int | None = None  # a beam: the top k of its row it needs each step (else params.logprobs)
    # Speculative decoding: this step's draft tokens, computed after its last token and verified in the same
    # forward (never in token_ids until accepted); the counts behind its acceptance rate and usage.
    draft: Draft | None = None
    num_drafts: int = 0  # steps that verified a draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_rejections: int = 0  # drafts that had a token rejected (the others were accepted whole)
    # Once finished, its KV blocks stay: forks are still to be taken from them (a retained request's sequence, or
    # the first completion of n until the others have forked off it).
    keep_blocks: bool = False
    lora: LoRASlot | None = None  # its request's adapter (None: the base model)
    trace: dict[int, TraceStep] | None = None  # position -> its step's record, when its params ask (engine/trace.py)

    @property
    def request_id(self) -> str:
        return self.seq_id.rpartition("/")[0]

    @property
    def index(self) -> int:
        """Its place among its request's sequences (the completion's index; a beam's id)."""
        return int(self.seq_id.rpartition("/")[2])

    @property
    def block_table(self) -> list[int]:
        """Its first group's blocks (a model with one group: its blocks)."""
        return self.block_tables[0] if self.block_tables else []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]
