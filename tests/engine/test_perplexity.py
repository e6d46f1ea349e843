"""Perplexity through the engine's model and KV cache, against transformers' plain forward of the same tokens."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import CORPUS
from tokenloop.engine.perplexity import perplexity

TEXT = " ".join(CORPUS * 3)


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_folder):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_folder, dtype=torch.float32).eval()


def reference_nll(hf_model, token_ids: list[int], window: int) -> tuple[float, int]:
    """Summed NLL and count, one plain transformers forward per window of `token_ids`."""
    total, count = 0.0, 0
    for start in range(0, len(token_ids), window):
        ids = torch.tensor([token_ids[start : start + window]])
        with torch.no_grad():
            logits = hf_model(ids).logits[0].float()  # [len, vocab]
        logprobs = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[0, 1:, None])
        total -= logprobs.double().sum().item()
        count += ids.shape[1] - 1
    return total, count


def test_one_window_equals_a_plain_transformers_forward(tiny_llm, hf_tiny):
    token_ids = tiny_llm.get_tokenizer().encode(TEXT)
    assert token_ids[0] == tiny_llm.get_tokenizer().bos_token_id and len(token_ids) <= 256
    result = perplexity(tiny_llm, TEXT, window=256)
    total, count = reference_nll(hf_tiny, token_ids, window=len(token_ids))
    assert result.num_scored_tokens == count == len(token_ids) - 1
    assert result.nll == pytest.approx(total / count, rel=1e-4)
    assert result.perplexity == pytest.approx(math.exp(total / count), rel=1e-4)


@pytest.mark.parametrize("window", [3, 16, 37])
def test_windows_are_fresh_contexts_scoring_all_but_their_first_token(tiny_llm, hf_tiny, window):
    token_ids = tiny_llm.get_tokenizer().encode(TEXT)
    result = perplexity(tiny_llm, TEXT, window=window)
    lengths = [len(token_ids[s : s + window]) for s in range(0, len(token_ids), window)]
    assert result.num_scored_tokens == sum(n - 1 for n in lengths)
    total, count = reference_nll(hf_tiny, token_ids, window)
    assert count == result.num_scored_tokens
    assert result.perplexity == pytest.approx(math.exp(total / count), rel=1e-4)


def test_a_last_window_of_one_token_scores_nothing(tiny_llm):
    n = len(tiny_llm.get_tokenizer().encode(TEXT))
    assert perplexity(tiny_llm, TEXT, window=n - 1).num_scored_tokens == n - 2


def test_max_tokens_scores_only_the_first_tokens(tiny_llm, hf_tiny):
    token_ids = tiny_llm.get_tokenizer().encode(TEXT)[:20]
    result = perplexity(tiny_llm, TEXT, window=64, max_tokens=20)
    total, count = reference_nll(hf_tiny, token_ids, window=64)
    assert result.num_scored_tokens == count == 19
    assert result.nll == pytest.approx(total / count, rel=1e-4)


def test_blocks_are_freed_and_the_prefix_cache_is_untouched(tiny_llm):
    blocks = tiny_llm.llm_engine.block_manager
    free, cached = blocks.num_free_blocks, dict(blocks.cached)
    perplexity(tiny_llm, TEXT, window=64)
    assert blocks.num_free_blocks == free and blocks.cached == cached


@pytest.mark.parametrize(
    ("text", "kwargs", "message"),
    [
        ("", {"window": 64}, "at least 2 tokens"),  # the tiny tokenizer adds BOS: one token
        (TEXT, {"window": 1}, "window must be >= 2"),
        (TEXT, {"window": 257}, "context length of 256"),
        (TEXT, {"window": 64, "max_tokens": 1}, "max_tokens must be >= 2"),
    ],
)
def test_bad_inputs_raise_value_error(tiny_llm, text, kwargs, message):
    with pytest.raises(ValueError, match=message):
        perplexity(tiny_llm, text, **kwargs)
