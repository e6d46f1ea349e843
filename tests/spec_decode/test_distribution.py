"""Speculative sampling keeps the target's distribution: 20,000 seeded samples of the next two tokens through the
whole engine, drafts verified at both positions, against the joint distribution computed from the model's own
probabilities (chi-square); the same test rejects a deliberately wrong acceptance rule."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.helpers import small_vocab_model
from tokenloop import LLM, SamplingParams
from tokenloop.spec_decode import rejection_sampler

VOCAB = 8
PROMPT = [2, 3, 4, 5, 2, 3, 4, 5, 2, 3]  # the lookup proposes 4, 5, 2, ... for the first token
REQUESTS, SAMPLES_PER_REQUEST = 20, 1000  # 20,000 samples


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = tmp_path_factory.mktemp("small_vocab_target")
    return folder, small_vocab_model(folder, VOCAB, seed=1)


@pytest.fixture(scope="module")
def draft_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("small_vocab_draft")
    small_vocab_model(folder, VOCAB, seed=2)  # another model: q differs from p, so rejections and residual draws happen
    return folder


@pytest.fixture(scope="module")
def exact(target) -> dict[tuple[int, int], float]:
    """P(x1, x2) = p(x1 | prompt) p(x2 | prompt, x1), from the model's float32 logits (transformers)."""
    _, model = target
    with torch.no_grad():
        first = model(torch.tensor([PROMPT])).logits[0, -1].double().softmax(-1)
        seconds = model(torch.tensor([PROMPT + [x] for x in range(VOCAB)])).logits[:, -1].double().softmax(-1)
    return {(a, b): float(first[a] * seconds[a, b]) for a, b in itertools.product(range(VOCAB), repeat=2)}


def sample_pairs(folder, spec: dict) -> tuple[list[tuple[int, int]], LLM]:
    llm = LLM(folder, dtype="float32", device="cpu", kv_cache_gb=0.05, max_num_seqs=256, speculative_config=spec)
    # Three tokens, so that the first step drafts two (the last token is never drafted: the bonus covers it) and
    # both positions of the pair are verified.
    params = [
        SamplingParams(
            n=SAMPLES_PER_REQUEST, seed=r * SAMPLES_PER_REQUEST, temperature=1.0, max_tokens=3, ignore_eos=True
        )
        for r in range(REQUESTS)
    ]
    outs = llm.generate([PROMPT] * REQUESTS, params, use_tqdm=False)
    return [tuple(c.token_ids[:2]) for o in outs for c in o.outputs], llm


def chi_square_p_value(pairs: list[tuple[int, int]], exact: dict[tuple[int, int], float]) -> float:
    """Cells expected fewer than 5 times are pooled into one."""
    from scipy.stats import chisquare

    n = len(pairs)
    counts = {cell: 0 for cell in exact}
    for pair in pairs:
        counts[pair] += 1
    big = [cell for cell, p in exact.items() if p * n >= 5]
    small = [cell for cell in exact if cell not in big]
    observed = [counts[c] for c in big] + ([sum(counts[c] for c in small)] if small else [])
    expected = [exact[c] * n for c in big] + ([sum(exact[c] for c in small) * n] if small else [])
    expected = [e * len(pairs) / sum(expected) for e in expected]  # float64 rounding: the totals must agree exactly
    return float(chisquare(observed, expected).pvalue)


NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 2,
    "adaptive": False,
}


@pytest.fixture(scope="module")
def eagle_folder(target, tmp_path_factory):
    """A random EAGLE head on 6 of the 8 tokens: q is zero on the other two, which the target still samples."""
    from tests.eagle_helpers import write_random_drafter

    return write_random_drafter(tmp_path_factory.mktemp("small_vocab_eagle"), target[0], 6, seed=3)


@pytest.mark.parametrize("proposer", ["ngram", "draft", "eagle"])
def test_two_token_joint_distribution_with_drafts_is_the_models(target, draft_folder, eagle_folder, exact, proposer):
    model = {"draft": draft_folder, "eagle": eagle_folder}.get(proposer)
    spec = (
        NGRAM
        if proposer == "ngram"
        else {"method": proposer, "model": str(model), "num_speculative_tokens": 2, "adaptive": False}
        | ({"dtype": "float32"} if proposer == "draft" else {})
    )
    pairs, llm = sample_pairs(target[0], spec)
    assert len(pairs) == REQUESTS * SAMPLES_PER_REQUEST
    stats = llm.llm_engine.speculator.stats
    # Every sample verified a draft of two tokens at its first step; some drafts were accepted, some rejected,
    # at both positions.
    assert stats.num_drafts >= len(pairs) and stats.num_draft_tokens >= 2 * len(pairs)
    assert 0 < stats.accepted_per_position[1] < stats.accepted_per_position[0] < stats.num_drafts
    assert chi_square_p_value(pairs, exact) >= 0.01


def test_the_same_test_fails_on_a_wrong_acceptance_rule(target, exact, monkeypatch):
    # The classic mistake: after a rejection, draw from p (the rejected token included) instead of max(p - q, 0).
    monkeypatch.setattr(rejection_sampler, "_residual", lambda p, seq, j, x: p)
    pairs, _ = sample_pairs(target[0], NGRAM)
    assert chi_square_p_value(pairs, exact) < 0.01
