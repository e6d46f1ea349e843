"""Perplexity of a text under the engine's own model: exp of the mean negative log-likelihood of its tokens.

The text is split into non-overlapping windows; each window is a fresh context run through the engine's model
runner and KV cache (a throwaway sequence whose blocks are freed afterwards and never enter the prefix cache),
and every token after the first of a window is scored from the logits at the position before it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tokenloop.engine.scheduler import ScheduledBatch
from tokenloop.engine.sequence import Sequence
from tokenloop.sampling.params import SamplingParams

if TYPE_CHECKING:
    from tokenloop.engine.llm_engine import LLMEngine
    from tokenloop.llm import LLM


@dataclass(slots=True)
class PerplexityResult:
    perplexity: float  # exp(nll)
    num_scored_tokens: int  # every token but the first of each window
    nll: float  # mean negative log-likelihood per scored token, in nats


def perplexity(llm: LLM, text: str, window: int = 512, max_tokens: int | None = None) -> PerplexityResult:
    """Score `text` (its first `max_tokens` tokens, if given) in windows of `window` tokens.

    Call it between engine steps: it borrows free KV blocks and the model runner for the duration of the call.
    """
    engine = llm.llm_engine
    if window < 2:
        raise ValueError(f"window must be >= 2, got {window}")
    if window > engine.max_model_len:
        raise ValueError(f"window must be <= the context length of {engine.max_model_len}, got {window}")
    if max_tokens is not None and max_tokens < 2:
        raise ValueError(f"max_tokens must be >= 2 (one token is scored from the one before it), got {max_tokens}")
    token_ids = engine.tokenizer.encode(text)  # with BOS first if the tokenizer adds one
    if max_tokens is not None:
        token_ids = token_ids[:max_tokens]
    if len(token_ids) < 2:
        raise ValueError(f"perplexity needs a text of at least 2 tokens, got {len(token_ids)}")
    total, count = 0.0, 0
    for start in range(0, len(token_ids), window):
        chunk = token_ids[start : start + window]
        if len(chunk) < 2:  # a last window of one token has nothing to score
            break
        logprobs = window_logprobs(engine, chunk)
        total -= logprobs.double().sum().item()
        count += logprobs.numel()
    nll = total / count
    return PerplexityResult(perplexity=math.exp(nll), num_scored_tokens=count, nll=nll)


@torch.inference_mode()
def window_logprobs(engine: LLMEngine, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids) - 1] float32: log P(token_ids[i + 1] | token_ids[: i + 1]), one fresh context."""
    runner, blocks = engine.runner, engine.block_manager
    n = len(token_ids)
    seq = Sequence("perplexity", list(token_ids), n, SamplingParams(max_tokens=1, prompt_logprobs=0), score_prompt=True)
    if not blocks.allocate(seq, n):  # no prefix-cache lookup or registration: the blocks stay anonymous
        raise ValueError(
            f"a window of {n} tokens needs {blocks.blocks_needed(seq, n)} KV blocks, "
            f"{blocks.num_free_blocks} are free; use a smaller window or a larger kv_cache_gb"
        )
    out = []
    try:
        # Prefill in chunks of the engine's step budget, as the scheduler would, so memory stays bounded.
        while seq.num_computed_tokens < n:
            step = min(engine.config.max_num_batched_tokens, n - seq.num_computed_tokens)
            inp = runner.prepare(ScheduledBatch([seq], [step]))
            out += [row[0] for score in runner.score(runner.logits(inp), inp, [seq]) for row in score.samples.logprobs]
            seq.num_computed_tokens += step
    finally:
        blocks.free(seq)
    return torch.tensor(out)
