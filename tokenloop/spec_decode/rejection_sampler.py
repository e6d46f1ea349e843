"""Exact verification of draft tokens: the target's rows for a sequence's k + 1 positions in, its new tokens out.

Position by position, over the rows still verifying (gpt-fast's rule, batched):
- greedy rows accept a draft token while it equals the target's argmax; the first mismatch emits the argmax;
- random rows accept draft token x with probability min(1, p(x) / q(x)); a rejection emits a token drawn from
  normalise(max(p - q, 0)). A proposer without probabilities (n-gram lookup) has q one-hot on x: accept with
  probability p(x), else draw from p without x;
- a row whose drafts were all accepted emits one more token from p (the bonus token).
p is the target's distribution at that position after every control: the logits processors (penalties, logit
bias, the structured-output mask; they see the tokens accepted before the position), then temperature,
min-p, top-k and top-p (Sampler.probs). So the tokens have the distribution sampling without drafts gives.
A sequence without a draft emits one token from p at its one row, drawn exactly as the Sampler draws it.
"""

from __future__ import annotations

import torch

from tokenloop.engine.sequence import Sequence
from tokenloop.sampling.processors import apply_processors
from tokenloop.sampling.sampler import Sampler, SamplerOutput, SamplingBatch, argmax, gather_logprobs, random_sample


def draft_length(seq: Sequence) -> int:
    return len(seq.draft) if seq.draft is not None else 0


def _uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), generator=generator))


@torch.inference_mode()
def verify(
    logits: torch.Tensor, seqs: list[Sequence], num_logprobs: list[int | None]
) -> tuple[SamplerOutput, list[int]]:
    """logits [R, V] float32: 1 + draft_length(seq) rows per sequence, in order. Returns the emitted tokens
    (rows of a SamplerOutput, sequence after sequence; logprobs of the raw distribution at each token's
    position) and how many each sequence emitted (its accepted drafts and one more)."""
    vocab, device = logits.shape[-1], logits.device
    lengths = [draft_length(seq) for seq in seqs]
    first_rows = [0]
    for d in lengths:
        first_rows.append(first_rows[-1] + d + 1)
    emitted: list[list[int]] = [[] for _ in seqs]
    alive = list(range(len(seqs)))
    for j in range(max(lengths, default=0) + 1):
        if not alive:
            break
        rows = [first_rows[i] + j for i in alive]
        part = [seqs[i] for i in alive]
        params = [seq.params for seq in part]
        controls = [seq.controls for seq in part]
        batch = SamplingBatch.from_params(params, [seq.generator for seq in part], vocab, device)
        target = logits[torch.tensor(rows, device=device)]
        if any(c is not None for c in controls):  # they see the tokens accepted before this position
            histories = [
                seq.token_ids + emitted[i] if c is not None else seq.token_ids
                for seq, i, c in zip(part, alive, controls)
            ]
            target = apply_processors(target, params, histories, controls)
        best = argmax(target).tolist()
        probs = None if batch.all_greedy else Sampler.probs(target, batch)
        still, draws = [], []  # draws: (index in alive, weights to draw this row's token from)
        for r, (i, seq) in enumerate(zip(alive, part)):
            greedy = seq.params.greedy
            if j < lengths[i]:
                x = seq.draft.token_ids[j]
                if greedy:
                    accepted = x == best[r]
                else:
                    q_x = 1.0 if seq.draft.probs is None else float(seq.draft.probs[j, x])
                    accepted = _uniform(seq.generator) * q_x < float(probs[r, x])
                if accepted:
                    emitted[i].append(x)
                    still.append(i)
                elif greedy:
                    emitted[i].append(best[r])
                else:
                    draws.append((r, _residual(probs[r], seq, j, x)))
            elif greedy:
                emitted[i].append(best[r])
            else:
                draws.append((r, probs[r]))
        if draws:
            tokens = random_sample(torch.stack([w for _, w in draws]), [part[r].generator for r, _ in draws]).tolist()
            for (r, _), token in zip(draws, tokens):
                emitted[alive[r]].append(token)
        alive = still
    counts = [len(e) for e in emitted]
    token_ids = torch.tensor([t for e in emitted for t in e], dtype=torch.int64, device=device)
    wanted = [k for k in num_logprobs if k is not None]
    if not wanted:
        return SamplerOutput(token_ids, None, None, None), counts
    rows = torch.tensor([first_rows[i] + j for i, c in enumerate(counts) for j in range(c)], device=device)
    return gather_logprobs(logits[rows].log_softmax(dim=-1), token_ids, min(max(wanted), vocab)), counts


def _residual(p: torch.Tensor, seq: Sequence, j: int, x: int) -> torch.Tensor:
    """max(p - q, 0) after draft token j (x) was rejected; unnormalised (the draw only needs proportions)."""
    if seq.draft.probs is None:
        residual = p.clone()
        residual[x] = 0.0
    else:
        residual = (p - seq.draft.probs[j]).clamp_(min=0.0)
    # p == q (to rounding) is accepted with probability 1; a rejection then is rounding: draw from p.
    return residual if float(residual.sum()) > 0 else p
