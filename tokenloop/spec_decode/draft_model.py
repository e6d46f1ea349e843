"""Draft-model proposer: a cheaper model with the same vocabulary drafts k tokens, one batched forward per token.

It keeps its own KV cache blocks: a draft sequence per target sequence, its tokens the target's plus the
draft's own guesses. Before each proposal it keeps the K/V of the longest prefix it shares with the target
(what the target accepted) and computes the rest with its first forward; the next k - 1 forwards are decodes
(the compiled step, where the draft model has one). Random rows draw each draft token from the draft's
distribution after the request's temperature, min-p, top-k and top-p, and hand that q to the verifier;
greedy rows take the draft's argmax.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from tokenloop.engine.block_manager import BlockManager
from tokenloop.engine.compiled_decode import CompileSpec
from tokenloop.engine.kv_groups import kv_cache_windows
from tokenloop.engine.model_runner import ModelRunner
from tokenloop.engine.scheduler import ScheduledBatch
from tokenloop.engine.sequence import Sequence
from tokenloop.models.loader import load_model
from tokenloop.sampling.sampler import Sampler, SamplingBatch, argmax, random_sample
from tokenloop.spec_decode.cost_model import StepCosts
from tokenloop.spec_decode.proposer import Draft, Proposer


class DraftModelProposer(Proposer):
    @classmethod
    def load(
        cls,
        model: str | None,
        dtype: torch.dtype,
        kv_dtype: torch.dtype,
        keep_quantized: bool,
        device: torch.device,
        vocab_size: int,
        num_blocks: int,
        block_size: int,
        compile: bool,
        background: Callable[[Path], CompileSpec] | None,
    ) -> DraftModelProposer:
        """The draft model loaded as the engine loads any model, with a KV pool of as many blocks as the target's
        (not a byte more until used: the pools are memory maps). Its vocabulary must be the target's."""
        loaded = load_model(model, dtype, device, load_tokenizer=False, keep_quantized=keep_quantized)
        if loaded.config.vocab_size != vocab_size:
            raise ValueError(
                f"speculative_config.model {model!r} has a vocabulary of {loaded.config.vocab_size} tokens, "
                f"the target's has {vocab_size}: "
                "a draft model must share the target's tokenizer"
            )
        runner = ModelRunner(
            loaded.model,
            loaded.config,
            num_blocks,
            block_size,
            kv_dtype,
            device,
            compile,
            background(loaded.path) if background else None,
        )
        windows = kv_cache_windows(loaded.config)
        return cls(runner, BlockManager(num_blocks, block_size, enable_prefix_caching=False, windows=windows))

    def __init__(self, runner: ModelRunner, block_manager: BlockManager) -> None:
        self.runner, self.block_manager = runner, block_manager
        self.costs = StepCosts()  # one draft forward, by its query tokens
        self.states: dict[str, Sequence] = {}  # target seq_id -> its draft sequence
        self._synced: dict[str, int] = {}  # target tokens the draft sequence had matched at its last proposal

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Draft]:
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        work = {i: self._state(seq) for i, (seq, k) in enumerate(zip(seqs, num_tokens)) if k > 0}
        for step in range(max(num_tokens, default=0)):
            batch = ScheduledBatch([], [])
            rows = []
            for i, draft in work.items():
                if len(tokens[i]) != step or step >= num_tokens[i]:
                    continue
                n = draft.num_tokens - draft.num_computed_tokens
                if self.block_manager.allocate(
                    draft, draft.num_tokens
                ):  # else out of draft blocks: it drafts no further
                    batch.seqs.append(draft)
                    batch.num_new_tokens.append(n)
                    rows.append(i)
            if not batch:
                break
            started = time.perf_counter()
            inp = self.runner.prepare(batch)
            logits = self.runner.logits(inp)  # [len(rows), V]: each draft sequence's last position
            drawn, q = draw(logits, batch.seqs)
            if inp.decode_only:
                self.costs.observe(len(batch.seqs), time.perf_counter() - started)
            for r, (i, draft, n) in enumerate(zip(rows, batch.seqs, batch.num_new_tokens)):
                draft.num_computed_tokens += n
                draft.token_ids.append(drawn[r])
                tokens[i].append(drawn[r])
                if q is not None and not draft.params.greedy:
                    probs[i].append(q[r])
        return [Draft(t, torch.stack(p) if p else None) for t, p in zip(tokens, probs)]

    def _state(self, seq: Sequence) -> Sequence:
        """The draft sequence of `seq`, its tokens made the target's: K/V kept for the prefix they share."""
        draft = self.states.get(seq.seq_id)
        if draft is None:
            draft = self.states[seq.seq_id] = Sequence(
                seq.seq_id, list(seq.token_ids), seq.num_prompt_tokens, seq.params, seq.generator
            )
            self._synced[seq.seq_id] = seq.num_tokens
            return draft
        # The target only appends, so the two agree up to the target's length at the last proposal.
        same = self._synced[seq.seq_id]
        end = min(draft.num_tokens, seq.num_tokens)
        while same < end and draft.token_ids[same] == seq.token_ids[same]:
            same += 1
        del draft.token_ids[same:]
        draft.token_ids += seq.token_ids[same:]
        draft.num_computed_tokens = min(draft.num_computed_tokens, same, seq.num_tokens - 1)
        self._synced[seq.seq_id] = seq.num_tokens
        return draft

    def release(self, seq: Sequence) -> None:
        if (draft := self.states.pop(seq.seq_id, None)) is not None:
            self.block_manager.free(draft)
            del self._synced[seq.seq_id]


def draw(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], torch.Tensor | None]:
    """A draft token per row of `logits` by seqs[row]'s parameters: the argmax for greedy rows, a draw from q (the
    request's temperature, min-p, top-k and top-p applied) for the others, q returned ([rows, V]; None: all greedy)."""
    params = [s.params for s in seqs]
    batch = SamplingBatch.from_params(params, [s.generator for s in seqs], logits.shape[-1], logits.device)
    if batch.all_greedy:
        return argmax(logits).tolist(), None
    q = Sampler.probs(logits, batch)
    drawn = torch.where(batch.temperature == 0, argmax(logits), random_sample(q, batch.generators))
    return drawn.tolist(), q
