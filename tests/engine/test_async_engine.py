"""AsyncEngine's bounds: a reader that falls behind pauses its request (blocks kept) and resumes it unchanged, or
loses it after the unread timeout; requests beyond max_waiting are refused; a draining engine takes none."""

from __future__ import annotations

import asyncio
import time

import pytest

from tokenloop.engine.async_engine import AsyncEngine, AsyncEngineConfig, EngineBusy, EngineDraining, RequestFailed
from tokenloop.engine.config import EngineConfig
from tokenloop.sampling.params import SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
PROMPT = [5, 6, 7, 8]


@pytest.fixture
def make_engine(tiny_model_folder):
    engines = []

    def make(**limits) -> AsyncEngine:
        engines.append(
            AsyncEngine(
                EngineConfig(str(tiny_model_folder), dtype="float32", device="cpu", kv_cache_gb=0.01),
                config=AsyncEngineConfig(**limits),
            )
        )
        return engines[-1]

    yield make
    for engine in engines:
        engine.shutdown()


async def read_all(engine: AsyncEngine, prompt=PROMPT, params=PARAMS):
    out = None
    async for out in engine.generate(prompt, params):
        pass
    return out


def test_a_reader_that_stops_taking_outputs_pauses_its_request_until_it_reads_again(make_engine):
    engine = make_engine(max_unread_outputs=4)

    async def scenario():
        expected = (await read_all(engine)).outputs[0].token_ids
        stream = engine.generate(PROMPT, PARAMS)
        first = await stream.__anext__()
        await asyncio.sleep(1.0)  # the reader takes nothing: after 4 outputs its request is paused
        paused = list(engine.engine.scheduler.paused)
        made = len(paused[0].output_token_ids) if paused else None
        await asyncio.sleep(0.5)
        still = len(paused[0].output_token_ids) if paused else None
        out = first
        async for out in stream:
            pass
        return expected, paused, made, still, out

    expected, paused, made, still, out = asyncio.run(scenario())
    assert len(paused) == 1 and made == still and made < 200  # paused, and no progress while paused
    assert out.finished and out.outputs[0].token_ids == expected
    assert engine.engine.block_manager.num_used_blocks == 0 and engine.num_in_flight == 0


def test_a_reader_gone_quiet_past_the_unread_timeout_loses_its_request_and_its_blocks(make_engine):
    engine = make_engine(max_unread_outputs=2, unread_timeout_s=0.5)

    async def scenario():
        stream = engine.generate(PROMPT, PARAMS)
        await stream.__anext__()
        await asyncio.sleep(1.5)
        with pytest.raises(RequestFailed, match="read nothing for 0.5 s"):
            async for _ in stream:
                pass

    asyncio.run(scenario())
    deadline = time.monotonic() + 5
    while engine.engine.block_manager.num_used_blocks and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.engine.block_manager.num_used_blocks == 0 and not engine.engine.requests


def test_requests_beyond_max_waiting_are_refused_and_a_draining_engine_takes_none(make_engine):
    engine = make_engine(max_waiting=2)

    async def scenario():
        engine.admit(2)
        streams = [engine.generate(PROMPT, PARAMS) for _ in range(2)]
        started = [asyncio.ensure_future(s.__anext__()) for s in streams]
        await asyncio.sleep(0)  # both generators have registered as waiting
        with pytest.raises(EngineBusy, match="2 requests are waiting already"):
            engine.admit(1)
        await asyncio.gather(*started)
        engine.admit(2)  # they have their first token: no longer waiting
        for s in streams:
            await s.aclose()
        engine.draining = True
        with pytest.raises(EngineDraining):
            engine.admit(1)

    asyncio.run(scenario())


def test_abort_all_ends_each_stream_with_finish_reason_abort(make_engine):
    engine = make_engine()

    async def scenario():
        streams = [engine.generate([5 + i, 6], PARAMS) for i in range(3)]
        firsts = await asyncio.gather(*(s.__anext__() for s in streams))
        engine.abort_all()
        lasts = []
        for s in streams:
            out = None
            async for out in s:
                pass
            lasts.append(out)
        return firsts, lasts

    firsts, lasts = asyncio.run(scenario())
    for out in lasts:
        assert out.finished and out.outputs[0].finish_reason == "abort" and len(out.outputs[0].token_ids) < 200
    assert engine.engine.block_manager.num_used_blocks == 0


def test_health_follows_the_step_loop(make_engine):
    engine = make_engine(stall_timeout_s=0.5)
    assert engine.healthy()
    engine._command("add", "stall", None, None)  # not a prompt: the command fails, the loop goes on
    time.sleep(0.2)
    assert engine.healthy()
    engine.shutdown()
    assert not engine.healthy()
