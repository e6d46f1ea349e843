"""Forks from any position of a retained request (what the explorer's branches are), and traced sequences: the raw
logits each step chose from, the stages recomputed from them, and the seeded draw found again."""

from __future__ import annotations

import pytest

from tokenloop import SamplingParams
from tokenloop.engine.requests import Fork
from tokenloop.engine.trace import redraw
from tokenloop.sampling.processors import LogitControls
from tokenloop.sampling.stages import distribution_stages, final_probs

ENGINE = {"kv_cache_gb": 0.02, "enable_prefix_caching": True}


def test_a_fork_inside_a_block_shares_the_blocks_before_it_and_generates_as_a_fresh_prompt(
    make_llm, long_context_model_folder
):
    llm = make_llm(long_context_model_folder, **ENGINE)
    engine, bs = llm.llm_engine, llm.llm_engine.config.block_size
    prompt = list(range(5, 5 + 2 * bs + 3))
    greedy = SamplingParams(temperature=0, max_tokens=bs, ignore_eos=True)
    parent = engine.add_request(prompt, greedy, retain=True)
    (out,) = llm._run([parent], use_tqdm=False)
    written = prompt + out.outputs[0].token_ids
    at = 2 * bs + 5  # inside the third block, which is full and in the prefix cache
    suffix = [(written[at] + 1) % 300 + 2]
    child = engine.add_request(
        {"prompt_token_ids": written[:at] + suffix}, greedy, retain=True, fork_of=Fork(parent, at)
    )
    (forked,) = llm._run([child], use_tqdm=False)
    parent_table = engine.retained(parent).block_table
    child_table = engine.retained(child).block_table
    assert child_table[:2] == parent_table[:2] and child_table[2] != parent_table[2]  # copy on write at block 2
    assert all(engine.block_manager.blocks[b].ref_count == 2 for b in parent_table[:2])
    with pytest.raises(ValueError, match="must start with"):
        engine.add_request({"prompt_token_ids": [9] + written[1:at]}, greedy, fork_of=Fork(parent, at))
    engine.release_request(parent)
    engine.release_request(child)
    assert engine.block_manager.num_used_blocks == 0
    fresh = make_llm(long_context_model_folder, **ENGINE).generate(
        [{"prompt_token_ids": written[:at] + suffix}], greedy, use_tqdm=False
    )
    assert forked.outputs[0].token_ids == fresh[0].outputs[0].token_ids
    (again,) = llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)
    # The parent's prompt comes from the prefix cache, whose blocks the fork did not write into.
    assert again.num_cached_tokens == 2 * bs and again.outputs[0].token_ids == out.outputs[0].token_ids


@pytest.mark.parametrize("greedy", [False, True])
def test_a_traced_step_keeps_the_raw_logits_its_token_came_from_and_the_draw(tiny_llm, greedy):
    engine = tiny_llm.llm_engine
    params = SamplingParams(
        temperature=0 if greedy else 0.8,
        top_k=40,
        top_p=0.9,
        seed=11,
        max_tokens=6,
        ignore_eos=True,
        trace=True,
        repetition_penalty=1.3,
        logit_bias={7: 2.0},
    )
    prompt = [0, 5, 6, 7, 8]
    rid = engine.add_request({"prompt_token_ids": prompt}, params, retain=True)
    (out,) = tiny_llm._run([rid], use_tqdm=False)
    seq = engine.retained(rid)
    tokens = out.outputs[0].token_ids
    assert sorted(seq.trace) == list(range(len(prompt), len(prompt) + len(tokens)))
    untraced = tiny_llm.generate([{"prompt_token_ids": prompt}], SamplingParams(**{**_fields(params), "trace": False}))
    assert untraced[0].outputs[0].token_ids == tokens  # tracing changes no token
    for position, step in seq.trace.items():
        history = seq.token_ids[:position]
        controls = LogitControls.for_request(params, len(prompt), None, engine.tokenizer.eos_token_ids)
        stages = distribution_stages(step.raw, params, history, controls)
        chosen = seq.token_ids[position]
        if greedy:
            assert int(stages[-1].logits.argmax()) == chosen
        else:
            probs = final_probs(stages)
            assert int((probs / redraw(step, probs)).argmax()) == chosen
    engine.release_request(rid)


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__slots__}
