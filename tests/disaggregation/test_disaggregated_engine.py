"""Disaggregated serving end to end on the tiny model: a prefill and a decode worker process behind the frontend,
against colocated serving (AsyncEngine) of the same config — streaming, structured output, a LoRA adapter and an
EAGLE drafter on the decode side, cancellation, deduplicated handoffs, and a worker killed mid-request."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from tests.helpers import build_async_engine, build_disaggregated_engine, last_outputs
from tokenloop import SamplingParams
from tokenloop.engine.async_engine import RequestFailed
from tokenloop.engine.lora import LoRARequest
from tokenloop.sampling.params import StructuredOutputsParams

LONG = [(11 * i) % 390 + 5 for i in range(100)]  # 6 full blocks and 4 tokens
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(temperature=0.9, seed=5, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def engine_args(tiny_model_folder, tiny_lora, tiny_drafter_folder) -> dict:
    adapter, _ = tiny_lora
    spec = {"method": "eagle", "model": str(tiny_drafter_folder), "num_speculative_tokens": 3, "adaptive": False}
    return {"lora_modules": (LoRARequest("tiny", str(adapter)),), "speculative_config": spec}


@pytest.fixture(scope="module")
def disaggregated(tiny_model_folder, engine_args):
    engine = build_disaggregated_engine(tiny_model_folder, **engine_args)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def colocated(tiny_model_folder, engine_args):
    engine = build_async_engine(tiny_model_folder, **engine_args)
    yield engine
    engine.shutdown()


def ids(prompt_token_ids: list[int]) -> dict:
    return {"prompt_token_ids": prompt_token_ids}


async def run_with(engine, prompt, params, lora=None):
    """The request's outputs, as its stream gave them (a LoRA request through admission, as the server does)."""
    [processed] = await engine.admit_and_process([prompt], params, lora)
    return [out async for out in engine.generate(processed)]


def both(disaggregated, colocated, prompt, params, lora=None):
    async def go():
        return await asyncio.gather(
            run_with(disaggregated, prompt, params, lora), run_with(colocated, prompt, params, lora)
        )

    return asyncio.run(go())


def tokens(outs) -> list[list[int]]:
    return [c.token_ids for c in outs[-1].outputs]


def metric(engine, name: str, **labels) -> float:
    return engine.metrics.registry.get_sample_value(name, labels) or 0.0


def wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_streams_the_tokens_of_colocated_serving_greedy_seeded_and_n(disaggregated, colocated):
    for params in (GREEDY, SEEDED, SamplingParams(temperature=1.0, seed=9, n=3, max_tokens=12)):
        got, expected = both(disaggregated, colocated, ids(LONG), params)
        assert tokens(got) == tokens(expected)
        assert got[-1].finished and not any(o.finished for o in got[:-1])  # streamed (a slow reader gets fewer)
        assert got[-1].num_cached_tokens >= 6 * 16  # the prompt's full blocks came from the prefill worker


def test_structured_output_a_lora_adapter_and_the_eagle_drafter_run_on_the_decode_worker(
    disaggregated, colocated, tiny_lora
):
    regex = SamplingParams(
        temperature=0.9, seed=4, max_tokens=24, structured_outputs=StructuredOutputsParams(regex=r"[a-z]{4,12}\.")
    )
    got, expected = both(disaggregated, colocated, ids(LONG[:70]), regex)
    assert tokens(got) == tokens(expected)
    lora = LoRARequest("tiny", str(tiny_lora[0]))
    got, expected = both(disaggregated, colocated, ids(LONG[:80]), GREEDY, lora)
    base, _ = both(disaggregated, colocated, ids(LONG[:80]), GREEDY)
    assert tokens(got) == tokens(expected) != tokens(base)  # the adapter's blocks are its own, not the base's
    wait_for(lambda: metric(disaggregated, "tokenloop_spec_decode_num_drafts_total", worker="decode-0") > 0)


def test_a_second_prompt_on_the_same_prefix_moves_only_its_new_blocks(disaggregated):
    prefix = [(13 * i) % 390 + 5 for i in range(64)]  # 4 blocks
    copied = metric(disaggregated, "tokenloop_pd_blocks_copied_total")
    skipped = metric(disaggregated, "tokenloop_pd_blocks_skipped_total")
    asyncio.run(last_outputs(disaggregated, [(ids(prefix + [7] * 40), GREEDY)]))  # 6 full blocks to hand over
    assert metric(disaggregated, "tokenloop_pd_blocks_copied_total") - copied == 6
    asyncio.run(last_outputs(disaggregated, [(ids(prefix + [9] * 40), GREEDY)]))
    assert metric(disaggregated, "tokenloop_pd_blocks_copied_total") - copied == 6 + 2  # its own last 2 only
    assert metric(disaggregated, "tokenloop_pd_blocks_skipped_total") - skipped == 4
    assert metric(disaggregated, "tokenloop_pd_handoff_seconds_count") > 0
    assert metric(disaggregated, "tokenloop_pd_handoff_megabytes_total") > 0


def test_a_request_left_early_leaves_no_blocks_held_on_either_worker(disaggregated):
    async def leave_after_two():
        stream = disaggregated.generate(ids(LONG), SamplingParams(temperature=0, max_tokens=150, ignore_eos=True))
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 2:
                break
        await stream.aclose()

    asyncio.run(leave_after_two())
    for worker in ("prefill-0", "decode-0"):
        wait_for(lambda w=worker: metric(disaggregated, "tokenloop_kv_cache_blocks_in_use", worker=w) == 0)
    assert disaggregated.num_in_flight == 0


def test_a_killed_worker_fails_its_requests_clearly_and_is_started_again(long_context_model_folder):
    engine = build_disaggregated_engine(long_context_model_folder, kv_cache_gb=0.05)
    try:
        decode = next(w for w in engine.workers if w.name == "decode-0")

        async def killed_mid_stream():
            stream = engine.generate(ids(LONG), SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True))
            with pytest.raises(RequestFailed, match="the decode-0 worker died"):
                async for _ in stream:  # seconds of decoding: the kill comes long before its end
                    if decode.process.is_alive():
                        os.kill(decode.process.pid, signal.SIGKILL)

        asyncio.run(killed_mid_stream())
        wait_for(lambda: engine.health()["status"] == "ok", timeout=120)
        [out] = asyncio.run(last_outputs(engine, [(ids(LONG), GREEDY)]))
        assert out.finished and len(out.outputs[0].token_ids) == 20
        prefill = next(w for w in engine.workers if w.name == "prefill-0")
        os.kill(prefill.process.pid, signal.SIGKILL)
        wait_for(lambda: engine.health()["workers"]["prefill-0"] != "up")
        # Meanwhile prompts go straight to the decode worker.
        [out] = asyncio.run(last_outputs(engine, [(ids(LONG[:50]), GREEDY)]))
        assert out.finished and len(out.outputs[0].token_ids) == 20
        wait_for(lambda: engine.health()["status"] == "ok", timeout=120)
    finally:
        engine.shutdown()
