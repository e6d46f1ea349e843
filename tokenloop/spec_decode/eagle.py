"""EAGLE proposer: a one-layer head (models/eagle.py) drafts from the target's own features, batched over sequences.

After every target step it keeps each sequence's new features (the final hidden states of its computed tokens
that stand: a prefill chunk's, the last token's and the accepted drafts'). A proposal is then k head forwards over
the drafting sequences together: the first catches each head up on those features (one row per new token, into
the head's own paged KV cache, kept) and drafts token 1 from its last row; each next one feeds a row's own output
feature and the token it drafted (EAGLE), one row per sequence, drafting the next token. Those draft rows are
rolled back at once: the next proposal computes their positions again from the target's features.

The head's rows follow its target's computing: where the target took a prompt's first blocks from the prefix
cache, it starts at the first position the target computed (the head attends to what it has seen; the drafts are
worse for it, never the tokens); a completion forked off another's prompt starts from that one's features. Draft
tokens are drawn over the draft vocabulary (argmax for greedy rows; the request's temperature, min-p, top-k and
top-p for the others) and handed over as target ids, with q scattered into the target's vocabulary (zero outside
the draft's): verification stays exact.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from tokenloop.engine.block_manager import BlockManager
from tokenloop.engine.model_runner import PagedBatch, zeroed_pool
from tokenloop.engine.scheduler import ScheduledBatch
from tokenloop.engine.sequence import Sequence
from tokenloop.models import kv_layout
from tokenloop.models.config import ModelConfig
from tokenloop.models.eagle import DraftVocabHead, EagleHead, load_drafter
from tokenloop.spec_decode.cost_model import StepCosts
from tokenloop.spec_decode.draft_model import draw
from tokenloop.spec_decode.proposer import Draft, Proposer


@dataclass(slots=True)
class EagleState:
    """A sequence's head: `rows` holds its rows in the head's cache (num_computed_tokens of them, from the target's
    features only), row r being target position offset + r; `chunks` hold the target's features [m, d] of the
    positions after, not yet consumed, as the steps gave them (joined only when consumed: a sequence the cost
    model keeps from drafting gathers them for many steps)."""

    rows: Sequence
    offset: int
    chunks: list[torch.Tensor] = field(default_factory=list)

    @property
    def next_position(self) -> int:
        """The target position whose feature the next head row consumes."""
        return self.offset + self.rows.num_computed_tokens

    @property
    def num_pending(self) -> int:
        return sum(len(c) for c in self.chunks)

    def pending(self, n: int) -> torch.Tensor:
        """The first n pending features, [n, d], kept pending."""
        joined = torch.cat(self.chunks) if len(self.chunks) > 1 else self.chunks[0]
        self.chunks = [joined]
        return joined[:n]

    def consume(self, n: int) -> None:
        self.chunks = [self.pending(self.num_pending)[n:]]


class EagleProposer(Proposer):
    wants_hidden_states = True

    @classmethod
    def load(
        cls,
        folder: str,
        target: nn.Module,
        target_config: ModelConfig,
        dtype: torch.dtype,
        kv_dtype: torch.dtype,
        device: torch.device,
        num_blocks: int,
        block_size: int,
    ) -> EagleProposer:
        """The drafter in `folder` (refused if it does not fit the target), with a KV pool of as many blocks as the
        target's for its one layer (a memory map on the CPU: nothing is taken until used)."""
        return cls(load_drafter(folder, target_config, dtype, device), target, num_blocks, block_size, kv_dtype)

    def __init__(
        self, head: EagleHead, target: nn.Module, num_blocks: int, block_size: int, kv_dtype: torch.dtype
    ) -> None:
        self.head, self.target = head, target
        self.device = head.d2t.device
        self.lm_head = DraftVocabHead(target, head.d2t)
        self.vocab_size = target.config.vocab_size
        attn = head.attention_layers()[0]
        shape = (attn.num_kv_heads, num_blocks * block_size, kv_layout.width(attn.head_dim, kv_dtype))
        attn.bind_cache(zeroed_pool(shape, kv_dtype, self.device), zeroed_pool(shape, kv_dtype, self.device))
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.costs = StepCosts()  # one head forward (and its draw), by the sequences in it
        self.warm = False  # the first proposal's timings hold one-off warm-up costs: the cost model does not see them
        self.states: dict[str, EagleState] = {}  # target seq_id -> its head

    @torch.inference_mode()
    def observe(self, batch: ScheduledBatch, num_sampled: list[int | None], hidden: torch.Tensor) -> None:
        row = 0
        for seq, n, got in zip(batch.seqs, batch.num_new_tokens, num_sampled):
            rows, row = hidden[row : row + n], row + n
            if got is None or seq.finish_reason is not None or seq.num_candidates is not None:
                continue  # failed (its rows may be wrong), ending (released next), or a beam (never drafts)
            d = len(seq.draft) if seq.draft is not None else 0
            self._keep(seq, seq.num_computed_tokens, rows[: n - d + max(got - 1, 0)])

    def _keep(self, seq: Sequence, start: int, features: torch.Tensor) -> None:
        """Keep the features of target positions [start, start + len(features)) the head has not consumed."""
        state = self.states.get(seq.seq_id)
        if state is None or start > state.next_position + state.num_pending:
            # New, or a gap (a step lost): the head starts over from here.
            if state is not None:
                self.block_manager.free(state.rows)
            state = self.states[seq.seq_id] = EagleState(Sequence(seq.seq_id, [], 0, seq.params), start)
        kept = max(start - state.next_position, 0)  # pending features before `start`
        skip = max(state.next_position - start, 0)  # positions the head has rows for already (a recompute)
        if skip < len(features):
            if kept < state.num_pending:
                state.chunks = [state.pending(kept)]
            state.chunks.append(features[skip:])

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Draft]:
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        # Catch-up: rows for positions next_position .. N - 2 (token p + 1 with feature p), kept in the head's cache.
        work, counts, ids, features = [], [], [], []
        for i, (seq, k) in enumerate(zip(seqs, num_tokens)):
            state = self.states.get(seq.seq_id)
            if not k or state is None:
                continue
            n, p = seq.num_tokens - 1 - state.next_position, state.next_position
            if (
                n < 1
                or state.num_pending < n
                or not self.block_manager.allocate(state.rows, state.rows.num_computed_tokens + n)
            ):
                continue  # nothing new from the target, or out of head blocks: it drafts nothing this step
            work.append(i)
            counts.append(n)
            ids += seq.token_ids[p + 1 : p + 1 + n]
            features.append(state.pending(n))
        if not work:
            return [Draft([]) for _ in seqs]
        states = [self.states[seqs[i].seq_id] for i in work]
        started = time.perf_counter()
        out = self._forward(states, counts, ids, torch.cat(features))  # [T, d]
        for s, n in zip(states, counts):
            s.consume(n)
        committed = [(s, s.rows.num_computed_tokens) for s in states]
        last = out[torch.tensor(list(itertools.accumulate(counts)), device=self.device) - 1]  # [B, d]: each last row
        try:
            for step in range(max(num_tokens[i] for i in work)):
                if step:  # one row each: its last draft token and the feature the row before gave
                    started = time.perf_counter()
                    last = self._forward(states, [1] * len(work), [tokens[i][-1] for i in work], last)
                drawn, q = draw(self.lm_head(last), [seqs[i] for i in work])
                if self.warm:
                    self.costs.observe(len(work), time.perf_counter() - started)
                target_ids = self.head.d2t[torch.tensor(drawn, device=self.device)].tolist()
                if q is not None:  # [B, Vd] -> [B, V], zero outside the draft vocabulary
                    q = q.new_zeros(len(work), self.vocab_size).index_copy_(1, self.head.d2t, q)
                for r, (i, token) in enumerate(zip(work, target_ids)):
                    tokens[i].append(token)
                    if q is not None and not seqs[i].params.greedy:
                        probs[i].append(q[r])
                keep = [
                    r
                    for r, (i, s) in enumerate(zip(work, states))
                    if len(tokens[i]) < num_tokens[i]
                    and self.block_manager.allocate(s.rows, s.rows.num_computed_tokens + 1)
                ]  # else done, or out of head blocks: it drafts no further
                if not keep:
                    break
                work, states = [work[r] for r in keep], [states[r] for r in keep]
                last = last[torch.tensor(keep, device=self.device)]
        finally:  # the draft rows go: only rows computed from the target's features stay
            self.warm = True
            for s, computed in committed:
                s.rows.num_computed_tokens = computed
        return [Draft(t, torch.stack(p) if p else None) for t, p in zip(tokens, probs)]

    def _forward(
        self, states: list[EagleState], counts: list[int], ids: list[int], features: torch.Tensor
    ) -> torch.Tensor:
        """Head rows for counts[b] tokens (`ids`, their features) of each state, from its computed rows on: [T, d]."""
        rows = [s.rows for s in states]
        paged = PagedBatch.of(
            [r.block_tables for r in rows],
            [r.num_computed_tokens for r in rows],
            counts,
            self.block_manager.block_size,
            self.device,
        )
        embeds = self.target.embed(torch.tensor(ids, dtype=torch.int64, device=self.device))
        out = self.head(embeds, features.to(embeds.dtype), paged.positions, paged.meta)
        for r, n in zip(rows, counts):
            r.num_computed_tokens += n
        return out

    def fork(self, parent: Sequence, child: Sequence, num_computed_tokens: int) -> None:
        """A child forked off a prompt its parent computed (n completions) starts from the parent's features, so
        that it drafts at its first step; where the parent's head has rows already, it starts from its own."""
        state = self.states.get(parent.seq_id)
        if state is None or state.rows.num_computed_tokens:
            return
        keep = num_computed_tokens - state.offset  # the positions the child does not compute again
        if keep > 0 and state.chunks:
            rows = Sequence(child.seq_id, [], 0, child.params)
            self.states[child.seq_id] = EagleState(rows, state.offset, [state.pending(keep)])

    def release(self, seq: Sequence) -> None:
        if (state := self.states.pop(seq.seq_id, None)) is not None:
            self.block_manager.free(state.rows)
