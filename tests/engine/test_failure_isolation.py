"""A failure tied to one request (preparing its rows, sampling its row, detokenizing its tokens) fails that
request alone: the step goes on, and every other request of the batch gets the tokens it gets without the fault."""

from __future__ import annotations

import pytest

from tokenloop import LLM, SamplingParams
from tokenloop.engine.faults import FaultInjection

MARKER = 399  # a token id of the tiny vocabulary that no test prompt below holds
PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def prompts_of_32() -> list[list[int]]:
    return [[5 + i, 6 + i, 7 + (i * 3) % 50] for i in range(31)]


def run_all(llm: LLM, prompts, params=PARAMS) -> dict[str, object]:
    """Every request to its end through engine.step(); returns the last output of each, by request id."""
    engine = llm.llm_engine
    ids = [engine.add_request(p, params) for p in prompts]
    last = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            last[out.request_id] = out
    assert all(out.finished for out in last.values())
    return [last[i] for i in ids]


@pytest.fixture(scope="module")
def reference(tiny_llm):
    return [o.outputs[0].token_ids for o in tiny_llm.generate(prompts_of_32(), PARAMS, use_tqdm=False)]


@pytest.mark.parametrize("stage", ["prepare", "sample", "detokenize"])
@pytest.mark.parametrize(
    "params",
    [PARAMS, SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True, logprobs=2)],
    ids=["greedy", "seeded"],
)
def test_a_fault_in_one_request_fails_it_alone_and_leaves_31_others_unchanged(tiny_model_folder, stage, params):
    clean = LLM(tiny_model_folder, dtype="float32", device="cpu", kv_cache_gb=0.01)
    faulty = LLM(
        tiny_model_folder, dtype="float32", device="cpu", kv_cache_gb=0.01, inject_faults=(f"{stage}:{MARKER}",)
    )
    expected = [o.outputs[0].token_ids for o in clean.generate(prompts_of_32(), params, use_tqdm=False)]
    prompts = prompts_of_32()
    prompts.insert(13, [5, MARKER, 8])
    outs = run_all(faulty, prompts, params)
    victim = outs.pop(13)
    assert victim.error is not None and "injected fault" in victim.error and victim.outputs == []
    assert [o.error for o in outs] == [None] * 31
    assert [o.outputs[0].token_ids for o in outs] == expected
    engine = faulty.llm_engine
    assert engine.block_manager.num_used_blocks == 0 and not engine.requests  # nothing of the victim left behind


def test_generate_raises_for_a_failed_request_naming_the_error(tiny_model_folder):
    faulty = LLM(
        tiny_model_folder, dtype="float32", device="cpu", kv_cache_gb=0.01, inject_faults=(f"sample:{MARKER}",)
    )
    with pytest.raises(RuntimeError, match="1 of 2 requests failed.*injected fault in sample"):
        faulty.generate([[5, 6], [5, MARKER]], PARAMS, use_tqdm=False)


def test_fault_specs_are_checked():
    assert FaultInjection.parse("sample:7") == FaultInjection("sample", 7)
    for bad in ("sample", "sample:x", "nowhere:3"):
        with pytest.raises(ValueError, match="inject_fault|fault stage"):
            FaultInjection.parse(bad)


def test_a_paused_request_keeps_its_blocks_runs_no_step_and_resumes_to_the_same_tokens(tiny_llm, reference):
    engine = tiny_llm.llm_engine
    ids = [engine.add_request(p, PARAMS) for p in prompts_of_32()]
    last = {}

    def run(steps: int | None = None) -> None:
        while engine.has_unfinished_requests() and (steps is None or steps > 0):
            for out in engine.step():
                last[out.request_id] = out
            steps = None if steps is None else steps - 1

    run(steps=3)
    engine.pause_request(ids[7])
    (paused,) = engine.scheduler.paused
    made, held = len(paused.output_token_ids), list(paused.block_table)
    run()  # the other 31 run to their end; the paused one is no work for a step
    assert set(engine.requests) == {ids[7]} and not engine.has_unfinished_requests()
    assert len(paused.output_token_ids) == made and paused.block_table == held  # no progress, its blocks kept
    engine.resume_request(ids[7])
    run()
    assert [last[i].outputs[0].token_ids for i in ids] == reference
    assert engine.block_manager.num_used_blocks == 0
