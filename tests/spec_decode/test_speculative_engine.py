"""Speculative decoding through the whole engine on the tiny model: drafts never change a greedy token, on every
path (a batch of 32 mixed with plain requests, prefix caching on and off, chunked prefill, preemption, n > 1,
processors), rejected tokens never reach the prefix cache, and no block is left behind."""

from __future__ import annotations

import re

import pytest

from tokenloop import LLM, SamplingParams

SHARED = "Hello world! Hello tokenizers, hello templates. " * 3
PROMPTS = [SHARED + tail for tail in ("The quick brown fox", "def main():", "Numbers like 12345", "I'm sure")] + [
    "so are emoji 😀 and 中文.",
    "The quick brown fox jumps over the lazy dog." * 2,
]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
# adaptive off: every sequence drafts all it may (the cost model would rarely draft on a model this small).
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    "adaptive": False,
}


def draft_config(folder) -> dict:
    # The draft is the tiny model itself in bfloat16: close to the target, not equal.
    return {
        "method": "draft",
        "model": str(folder),
        "dtype": "bfloat16",
        "num_speculative_tokens": 3,
        "adaptive": False,
    }


def tokens(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_nothing_held(llm: LLM) -> None:
    engine = llm.llm_engine
    assert engine.block_manager.num_used_blocks == 0
    proposer = engine.speculator.proposer
    if hasattr(proposer, "block_manager"):  # the draft model's own pool
        assert proposer.block_manager.num_used_blocks == 0 and not proposer.states


@pytest.fixture(scope="module")
def reference(tiny_llm):
    return tokens(tiny_llm, PROMPTS)


@pytest.fixture(params=["ngram", "draft"])
def spec(request, tiny_model_folder):
    return NGRAM if request.param == "ngram" else draft_config(tiny_model_folder)


@pytest.mark.parametrize(
    "engine_args",
    [{}, {"enable_prefix_caching": False}, {"max_num_batched_tokens": 7}],
    ids=["default", "no prefix cache", "chunked"],
)
def test_greedy_tokens_with_drafts_equal_those_without(make_llm, tiny_model_folder, reference, spec, engine_args):
    llm = make_llm(tiny_model_folder, speculative_config=spec, **engine_args)
    assert tokens(llm, PROMPTS) == reference
    stats = llm.llm_engine.speculator.stats
    assert (
        stats.num_draft_tokens > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    )  # drafts were verified, some rejected
    assert_nothing_held(llm)


def test_a_batch_of_32_mixing_drafting_and_plain_requests_changes_no_token(make_llm, tiny_model_folder, tiny_llm, spec):
    batch = (PROMPTS * 6)[:32]
    plain = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, seed=3)  # seeded: drafts all it may too
    sampled = SamplingParams(temperature=0.9, max_tokens=40, ignore_eos=True, seed=5)
    params = [GREEDY if i % 3 == 0 else plain if i % 3 == 1 else sampled for i in range(32)]
    expected = [o.outputs[0].token_ids for o in tiny_llm.generate(batch, params, use_tqdm=False)]
    llm = make_llm(tiny_model_folder, speculative_config=spec)
    got = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    greedy_rows = [i for i in range(32) if i % 3 != 2]
    assert [got[i] for i in greedy_rows] == [expected[i] for i in greedy_rows]
    again = [
        o.outputs[0].token_ids
        for o in make_llm(tiny_model_folder, speculative_config=spec).generate(batch, params, use_tqdm=False)
    ]
    assert again == got  # seeded sampling with drafts is reproducible
    assert_nothing_held(llm)


def test_preemption_with_drafts_changes_no_token(make_llm, tiny_model_folder, reference, spec):
    # A pool of 12 blocks of 16 tokens: the six sequences cannot all hold their context; some are preempted.
    llm = make_llm(tiny_model_folder, kv_blocks=12, speculative_config=spec)
    assert tokens(llm, PROMPTS) == reference
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert_nothing_held(llm)


@pytest.mark.parametrize(
    "controls",
    [
        {
            "repetition_penalty": 1.05,
            "frequency_penalty": 0.05,
            "presence_penalty": 0.02,
            "logit_bias": {5: 2.0},
            "min_tokens": 10,
        },
        {"no_repeat_ngram_size": 4, "bad_words": ["hello"]},
    ],
    ids=["penalties and bias", "n-gram and word bans"],
)
def test_processors_see_the_accepted_draft_tokens(make_llm, tiny_model_folder, tiny_llm, spec, controls):
    params = SamplingParams(temperature=0, max_tokens=40, **controls)
    expected = tokens(tiny_llm, PROMPTS, params)
    llm = make_llm(tiny_model_folder, speculative_config=spec)
    assert tokens(llm, PROMPTS, params) == expected
    assert (
        llm.llm_engine.speculator.stats.num_accepted_tokens > 0
    )  # later positions were judged with the earlier drafts applied


def test_structured_output_masks_apply_at_every_verified_position(make_llm, tiny_model_folder, tiny_llm, spec):
    from tokenloop.sampling.structured import StructuredOutputsParams

    regex = r"(ab|ba|abc){6,12}"
    prompts = ["ab ab ab abc abc ba ba", "Hello world"]
    params = [
        SamplingParams(temperature=t, max_tokens=40, seed=7, structured_outputs=StructuredOutputsParams(regex=regex))
        for t in (0, 0.8)
    ]
    expected = tiny_llm.generate(prompts, params[0], use_tqdm=False)
    llm = make_llm(tiny_model_folder, speculative_config=spec)
    got = llm.generate(prompts, params[0], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    sampled = llm.generate(prompts, params[1], use_tqdm=False)
    assert all(re.fullmatch(regex, o.outputs[0].text) and o.outputs[0].finish_reason == "stop" for o in got + sampled)
    if spec["method"] == "ngram":  # the draft model drafts without the grammar: its drafts here are all rejected
        assert llm.llm_engine.speculator.stats.num_accepted_tokens > 0


def test_n_greater_than_1_and_logprobs_with_drafts(make_llm, tiny_model_folder, tiny_llm, spec):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, n=3, logprobs=2)
    expected = tiny_llm.generate(PROMPTS[:2], params, use_tqdm=False)
    got = make_llm(tiny_model_folder, speculative_config=spec).generate(PROMPTS[:2], params, use_tqdm=False)
    for e, g in zip(expected, got):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in e.outputs]
        for ce, cg in zip(e.outputs, g.outputs):
            assert [sorted(d) for d in cg.logprobs] == [sorted(d) for d in ce.logprobs]
            assert cg.cumulative_logprob == pytest.approx(ce.cumulative_logprob, abs=1e-4)


def test_stop_strings_and_max_tokens_inside_an_accepted_run(make_llm, tiny_model_folder, tiny_llm, spec):
    reference = tokens(tiny_llm, PROMPTS[:1])[0]
    text = tiny_llm.get_tokenizer().decode(reference[10:13])
    for params in (
        SamplingParams(temperature=0, max_tokens=40, stop=[text]),
        SamplingParams(temperature=0, max_tokens=17, ignore_eos=True),
    ):
        expected = tiny_llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
        got = (
            make_llm(tiny_model_folder, speculative_config=spec)
            .generate(PROMPTS[:1], params, use_tqdm=False)[0]
            .outputs[0]
        )
        assert (got.token_ids, got.text, got.finish_reason) == (
            expected.token_ids,
            expected.text,
            expected.finish_reason,
        )


def test_rejected_draft_tokens_never_enter_the_prefix_cache(make_llm, tiny_model_folder, spec):
    llm = make_llm(tiny_model_folder, speculative_config=spec)
    engine = llm.llm_engine
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert engine.speculator.stats.num_accepted_tokens < engine.speculator.stats.num_draft_tokens
    sequences = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
    cached = [b for b in engine.block_manager.blocks if b.hash is not None]
    assert cached
    bs = engine.config.block_size
    for block in cached:  # each cached block holds a run of some sequence's real tokens, at a block boundary
        assert any(tuple(s[i : i + bs]) == block.token_ids for s in sequences for i in range(0, len(s) - bs + 1, bs)), (
            block
        )


def test_aborting_drafting_requests_leaves_no_block_behind(make_llm, tiny_model_folder, spec):
    llm = make_llm(tiny_model_folder, speculative_config=spec)
    engine = llm.llm_engine
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    for _ in range(30):
        engine.step()
        if engine.speculator.stats.num_draft_tokens > 0:
            break
    assert engine.speculator.stats.num_draft_tokens > 0 and engine.has_unfinished_requests()
    for request_id in ids:
        engine.abort_request(request_id)
    assert_nothing_held(llm)
