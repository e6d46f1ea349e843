"""n > 1 completions fork off the first once it has prefilled the prompt: they share its KV blocks (with
prefix caching off too), each copies only the partly filled last block it writes into, and forking changes
no token."""

from __future__ import annotations

import pytest

from tokenloop import SamplingParams

PROMPT = "Hello world! Hello tokenizers, hello templates. " * 3


@pytest.mark.parametrize(
    "engine_args",
    [{}, {"enable_prefix_caching": False}, {"max_num_batched_tokens": 7}],
    ids=["default", "no prefix cache", "chunked"],
)
def test_greedy_completions_forked_equal_the_request_alone(make_llm, tiny_model_folder, tiny_llm, engine_args):
    alone = (
        tiny_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )
    out = make_llm(tiny_model_folder, **engine_args).generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, n=3), use_tqdm=False
    )[0]
    assert [c.token_ids for c in out.outputs] == [alone] * 3


def test_seeded_completions_are_the_same_with_prefix_caching_on_and_off(make_llm, tiny_model_folder):
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True, n=4)
    on = make_llm(tiny_model_folder).generate([PROMPT, "The quick brown fox"], params, use_tqdm=False)
    off = make_llm(tiny_model_folder, enable_prefix_caching=False).generate(
        [PROMPT, "The quick brown fox"], params, use_tqdm=False
    )
    assert [[c.token_ids for c in o.outputs] for o in on] == [[c.token_ids for c in o.outputs] for o in off]
    assert len({tuple(c.token_ids) for c in on[0].outputs}) == 4  # four different samples, not one repeated


def test_eight_completions_of_a_long_prompt_hold_one_prompt_of_blocks_and_eight_tails(
    make_llm, long_context_model_folder
):
    llm = make_llm(long_context_model_folder, enable_prefix_caching=False, kv_cache_gb=0.05)
    engine, block_size = llm.llm_engine, llm.llm_engine.config.block_size
    prompt = list(range(5, 205)) * 5  # 1,000 tokens: 62 full blocks and one holding 8 tokens
    engine.add_request(prompt, SamplingParams(temperature=1.0, seed=0, n=8, max_tokens=6, ignore_eos=True))
    peak, outs = 0, []
    while engine.has_unfinished_requests():
        outs += engine.step()
        peak = max(peak, engine.block_manager.num_used_blocks)
    prompt_blocks = -(-len(prompt) // block_size)
    assert peak == prompt_blocks + 7  # the last block: the first completion's own, and a copy for each of 7 others
    assert len(outs[-1].outputs) == 8 and all(len(c.token_ids) == 6 for c in outs[-1].outputs)
    assert engine.block_manager.num_used_blocks == 0
