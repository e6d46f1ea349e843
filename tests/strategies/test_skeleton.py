"""Skeleton-of-thought on the tiny model (a 4,096-token context): the outline follows its grammar (3-5 numbered
points), each point is expanded by a sequence forked off the outline's, in the same steps, and the answer joins
the expansions in order. A retained request's forks share its blocks, and compute what a fresh prompt would."""

from __future__ import annotations

import re

import pytest

from tokenloop import SamplingParams
from tokenloop.strategies import skeleton

# A pool for the outline's forks, which share its blocks by forking, not through the prefix cache.
ENGINE = {"kv_cache_gb": 0.02, "enable_prefix_caching": False}


def test_the_outline_follows_its_grammar_and_each_point_is_expanded_in_order(
    make_llm, long_context_model_folder, monkeypatch
):
    llm = make_llm(long_context_model_folder, **ENGINE)
    engine = llm.llm_engine
    steps = []
    real_step = engine.step
    monkeypatch.setattr(engine, "step", lambda: steps.append(len(engine.scheduler.running)) or real_step())
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    result = llm.skeleton_of_thought("Hi", params)
    assert 3 <= len(result.points) <= 5 and len(result.expansions) == len(result.points)
    assert result.answer == "\n\n".join(e.strip() for e in result.expansions)
    assert max(steps) >= len(result.points)  # the expansions ran side by side
    assert re.fullmatch(skeleton.OUTLINE, "\n".join(f"{i + 1}. {p}" for i, p in enumerate(result.points)))
    assert (
        llm.skeleton_of_thought("Hi", params, together=False).expansions == result.expansions
    )  # the same prompts, one by one
    assert engine.block_manager.num_used_blocks == 0


def test_forks_of_a_retained_request_share_its_blocks_and_generate_as_fresh_prompts(
    make_llm, long_context_model_folder
):
    llm = make_llm(long_context_model_folder, **ENGINE)
    engine, block_size = llm.llm_engine, llm.llm_engine.config.block_size
    prompt = list(range(5, 105))  # 100 tokens: 6 full blocks and 4 tokens
    parent = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), retain=True)
    (out,) = llm._run([parent], use_tqdm=False)
    written = prompt + out.outputs[0].token_ids
    held = engine.block_manager.num_used_blocks
    assert held == -(-(len(written) - 1) // block_size)  # kept after finishing (its last token has no K/V yet)
    suffixes = [[7, 8, 9], [10, 11], [12]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    children = engine.fork_request(parent, suffixes, params)
    engine.step()
    shared = [engine.requests[c].completions[0].seq.block_table[: len(written) // block_size] for c in children]
    assert all(table == shared[0] for table in shared)  # the parent's full blocks, by reference
    forked = [o.outputs[0].token_ids for o in llm._run(children, use_tqdm=False)]
    engine.release_request(parent)
    assert engine.block_manager.num_used_blocks == 0
    fresh = make_llm(long_context_model_folder, **ENGINE).generate(
        [written + s for s in suffixes], params, use_tqdm=False
    )
    assert forked == [o.outputs[0].token_ids for o in fresh]
    with pytest.raises(ValueError, match="retain=True"):
        engine.fork_request(parent, [[1]], params)


def test_a_fork_with_n_completions_forks_them_off_its_first_and_ends(make_llm, long_context_model_folder):
    llm = make_llm(long_context_model_folder, **ENGINE)
    engine = llm.llm_engine
    prompt = list(range(5, 45))
    parent = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), retain=True)
    (out,) = llm._run([parent], use_tqdm=False)
    params = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=5, ignore_eos=True)
    (forked,) = llm._run(engine.fork_request(parent, [[7, 8]], params), use_tqdm=False)
    engine.release_request(parent)
    assert forked.finished and engine.block_manager.num_used_blocks == 0 and not engine.requests
    fresh = make_llm(long_context_model_folder, **ENGINE).generate(prompt + out.outputs[0].token_ids + [7, 8], params)
    assert [c.token_ids for c in forked.outputs] == [c.token_ids for c in fresh[0].outputs]
