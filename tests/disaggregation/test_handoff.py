"""The KV handoff in one process: blocks computed by an engine whose pools are in shared memory, taken by another
engine (copied where it lacks them, skipped where it holds them), give that engine's own tokens."""

from __future__ import annotations

import uuid

import pytest

from tokenloop import SamplingParams
from tokenloop.disaggregation.handoff import KVHandoff, PeerPools, take_blocks
from tokenloop.engine.shared_pools import SharedPools, pool_paths, remove_pools

PROMPT = {"prompt_token_ids": [(7 * i) % 390 + 5 for i in range(90)]}  # 5 full blocks of 16, and 10 tokens
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture
def prefill(make_llm, tiny_model_folder):
    name = f"tokenloop-test-{uuid.uuid4().hex[:8]}"
    llm = make_llm(tiny_model_folder, kv_shared_memory=name)
    yield llm, name
    remove_pools(name)


def prefilled(llm, prompt) -> KVHandoff:
    engine = llm.llm_engine
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1), request_id="p", retain=True)
    while engine.has_unfinished_requests():
        engine.step()
    blocks = engine.retained_blocks("p")
    return KVHandoff(llm.llm_engine.config.kv_shared_memory, blocks)


def decode(llm, prompt) -> tuple[list[int], int]:
    out = llm.generate(prompt, PARAMS, use_tqdm=False)[0]
    return out.outputs[0].token_ids, out.num_cached_tokens


def test_taken_blocks_give_the_tokens_of_computing_the_prompt(make_llm, tiny_model_folder, prefill):
    llm, name = prefill
    assert len(pool_paths(name)) == 4  # 2 layers, K and V
    expected, _ = decode(make_llm(tiny_model_folder, enable_prefix_caching=False), PROMPT)
    handoff = prefilled(llm, PROMPT)
    assert len(handoff.blocks) == 5
    target = make_llm(tiny_model_folder)
    stats = take_blocks(target.llm_engine, PeerPools(), handoff, PROMPT["prompt_token_ids"])
    assert (stats.copied, stats.skipped) == (5, 0) and stats.bytes > 0
    tokens, cached = decode(target, PROMPT)
    assert tokens == expected and cached == 5 * 16
    again = take_blocks(target.llm_engine, PeerPools(), handoff, PROMPT["prompt_token_ids"])
    assert (again.copied, again.skipped, again.bytes) == (0, 5, 0)  # held already: nothing moves
    llm.llm_engine.release_request("p")


def test_with_too_few_free_blocks_a_leading_run_is_taken_and_the_rest_computed(make_llm, tiny_model_folder, prefill):
    llm, _ = prefill
    expected, _ = decode(make_llm(tiny_model_folder, enable_prefix_caching=False), PROMPT)
    handoff = prefilled(llm, PROMPT)
    target = make_llm(tiny_model_folder, kv_blocks=8).llm_engine
    target.add_request({"prompt_token_ids": list(range(10, 70))}, PARAMS, request_id="other")
    target.step()  # the other request holds 4 of the 8 blocks: 4 are free for the 5 handed over
    stats = take_blocks(target, PeerPools(), handoff, PROMPT["prompt_token_ids"])
    assert (stats.copied, stats.skipped) == (4, 0)
    target.add_request(PROMPT, PARAMS, request_id="mine")
    outputs = {}
    while target.has_unfinished_requests():  # the two need more blocks than there are: one is preempted
        outputs |= {out.request_id: out for out in target.step() if out.finished}
    assert outputs["mine"].outputs[0].token_ids == expected
    llm.llm_engine.release_request("p")


def test_shared_pools_are_for_the_cpu_and_a_plain_name():
    import torch

    with pytest.raises(ValueError, match="kv_shared_memory must be a plain file name"):
        SharedPools("a/b")
    with pytest.raises(ValueError, match="is not the CPU"):
        SharedPools("x")((1, 16, 8), torch.float32, torch.device("meta"))
