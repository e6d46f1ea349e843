"""The logits processors against plain per-row reference implementations (a loop over tokens, as the rules are
written in transformers, OpenAI's docs and vLLM), alone and combined, with rows that use none mixed in; and
through the engine, greedy and random rows in one batch."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloop.sampling.params import SAMPLING_EPS, SamplingParams
from tokenloop.sampling.processors import LARGEST_LOGIT, LogitControls, apply_processors

VOCAB = 24
EOS = 23


def reference(
    logits: list[float], p: SamplingParams, tokens: list[int], num_prompt: int, bad_words_ids: list[list[int]]
) -> list[float]:
    out = list(logits)
    output = tokens[num_prompt:]
    if p.allowed_token_ids is not None:
        out = [x if t in p.allowed_token_ids else -math.inf for t, x in enumerate(out)]
    for word in bad_words_ids:
        if output[len(output) - len(word) + 1 :] == word[:-1] or len(word) == 1:
            out[word[-1]] = -math.inf
    if len(output) < p.min_tokens:
        for t in set(p.stop_token_ids) | {EOS}:
            out[t] = -math.inf
    for t, bias in (p.logit_bias or {}).items():
        out[t] += bias
    for t in set(tokens):  # transformers' RepetitionPenaltyLogitsProcessor
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(output):  # OpenAI's presence and frequency penalties
        out[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    n = p.no_repeat_ngram_size
    if n and len(tokens) + 1 >= n:  # transformers' NoRepeatNGramLogitsProcessor
        prefix = tokens[len(tokens) - n + 1 :] if n > 1 else []
        for i in range(len(tokens) - n + 1):
            if tokens[i : i + n - 1] == prefix:
                out[tokens[i + n - 1]] = -math.inf
    return out


token = st.integers(0, VOCAB - 1)
params_strategy = st.builds(
    SamplingParams,
    allowed_token_ids=st.none() | st.lists(token, min_size=1, max_size=6),
    min_tokens=st.integers(0, 4),
    stop_token_ids=st.lists(token, max_size=2),
    logit_bias=st.none() | st.dictionaries(token, st.floats(-100, 100), max_size=4),
    repetition_penalty=st.sampled_from([1.0, 1.3, 0.8]),
    presence_penalty=st.sampled_from([0.0, 0.5, -1.0]),
    frequency_penalty=st.sampled_from([0.0, 0.7, 2.0]),
    no_repeat_ngram_size=st.integers(0, 3),
    max_tokens=st.just(16),
)
row_strategy = st.tuples(
    params_strategy,
    st.lists(token, min_size=1, max_size=5),
    st.lists(token, max_size=8),
    st.lists(st.lists(token, min_size=1, max_size=3), max_size=2),
)


@settings(max_examples=150, deadline=None)
@given(rows=st.lists(row_strategy, min_size=1, max_size=5), seed=st.integers(0, 2**16))
def test_processors_match_the_reference_rules_row_by_row(rows, seed):
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    params, token_ids, controls, expected = [], [], [], []
    for p, prompt, output, bad_words_ids in rows:
        tokens = prompt + output
        c = LogitControls.for_request(p, len(prompt), lambda text: [], [EOS])
        if c is not None:
            c.bad_words_ids = bad_words_ids  # token sequences directly: the tokenizer's part is tested below
        params.append(p), token_ids.append(tokens), controls.append(c)
        expected.append(
            reference(logits[len(expected)].tolist(), p, tokens, len(prompt), bad_words_ids if c is not None else [])
        )
    before = logits.clone()
    out = apply_processors(logits, params, token_ids, controls)
    assert torch.equal(logits, before)  # the caller's logits are not written
    torch.testing.assert_close(out, torch.tensor(expected), rtol=1e-5, atol=1e-4)


def test_history_is_kept_incrementally_across_steps():
    p = SamplingParams(frequency_penalty=1.0, no_repeat_ngram_size=2)
    c = LogitControls.for_request(p, 2, lambda text: [], [EOS])
    tokens = [1, 2]
    for t in [3, 1, 3]:
        tokens.append(t)
        apply_processors(torch.zeros(1, VOCAB), [p], [tokens], [c])
    assert c.history.synced == 5 and dict(c.history.output_counts) == {3: 2, 1: 1}
    assert c.history.banned_by_ngrams(tokens) == {1}  # after "3": "3 1" was seen


@pytest.mark.parametrize("penalty", [2.2e-311, 1e-40, 1e-38])
def test_a_penalty_below_float32s_range_keeps_every_row_a_distribution(penalty):
    """A penalty > 0 that float32 rounds to 0 or divides past its largest number: the seen tokens of positive logit
    take LARGEST_LOGIT, which the smallest temperature still divides to a finite number, a masked one stays
    masked, and no logit is NaN (a NaN row has no token to sample)."""
    p = SamplingParams(repetition_penalty=penalty, allowed_token_ids=[1, 2, 3])
    logits = torch.tensor([[0.0, 5.0, -2.0, 1.0] + [0.5] * (VOCAB - 4)])
    out = apply_processors(logits, [p], [[0, 1, 2]], [LogitControls.for_request(p, 3, lambda text: [], [EOS])])
    assert not out.isnan().any()
    assert out[0, 1] == LARGEST_LOGIT and out[0, 3] == 1.0
    assert torch.isfinite(out[0, 1] / SAMPLING_EPS)
    assert out[0, 0] == -math.inf and out[0, 4:].eq(-math.inf).all()
    assert out.softmax(-1)[0].tolist() == [0.0, 1.0] + [0.0] * (VOCAB - 2)


def test_bad_words_are_tokenized_with_and_without_a_leading_space():
    encodings = {"cat": [5], " cat": [6, 7]}
    c = LogitControls.for_request(SamplingParams(bad_words=["cat"]), 1, lambda text: encodings[text], [EOS])
    assert c.bad_words_ids == [[5], [6, 7]]


@pytest.mark.parametrize(
    "field,value",
    [
        ("logit_bias", {3: 101}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {3: "x"}),
        ("repetition_penalty", 0),
        ("repetition_penalty", math.inf),
        ("presence_penalty", 2.5),
        ("frequency_penalty", "1"),
        ("min_tokens", -1),
        ("allowed_token_ids", []),
        ("bad_words", [" "]),
        ("no_repeat_ngram_size", -2),
    ],
)
def test_bad_processor_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_is_an_error():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=20, max_tokens=10)


def test_the_engine_applies_processors_to_greedy_and_random_rows_of_one_batch(tiny_llm):
    tok = tiny_llm.get_tokenizer()
    eos = tok.eos_token_ids[0] if tok.eos_token_ids else 0
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    allowed = [5, 9, 11]
    cases = [
        SamplingParams(temperature=0, max_tokens=12, allowed_token_ids=allowed),
        SamplingParams(temperature=0.9, seed=3, max_tokens=12, allowed_token_ids=allowed),
        SamplingParams(temperature=0, max_tokens=12, logit_bias={7: 100.0}),
        SamplingParams(temperature=0, max_tokens=12, min_tokens=12, logit_bias={eos: 100.0}, stop_token_ids=[8]),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, no_repeat_ngram_size=1),
        plain,
    ]
    prompts = ["Hello world"] * len(cases)
    outs = tiny_llm.generate(prompts, cases, use_tqdm=False)
    ids = [o.outputs[0].token_ids for o in outs]
    assert set(ids[0]) <= set(allowed) and set(ids[1]) <= set(allowed)
    assert ids[2] == [7] * 12  # +100 wins every step
    assert len(ids[3]) == 12 and eos not in ids[3] and 8 not in ids[3]  # EOS held off to min_tokens, though biased up
    assert len(set(ids[4])) == 12  # no 1-gram twice: every token new
    alone = tiny_llm.generate(prompts[-1], plain, use_tqdm=False)[0].outputs[0].token_ids
    assert ids[5] == alone  # a row without processors is untouched by its neighbours'


def test_min_tokens_beyond_the_context_without_max_tokens_is_an_error_before_queuing(tiny_llm):
    with pytest.raises(ValueError, match="min_tokens"):
        tiny_llm.generate("Hello", SamplingParams(max_tokens=None, min_tokens=10**6), use_tqdm=False)
    assert not tiny_llm.llm_engine.has_unfinished_requests()
