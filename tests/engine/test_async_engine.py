"""AsyncEngine's bounds: a reader that falls behind pauses its request (blocks kept) and resumes it unchanged, or
loses it after the unread timeout; requests beyond max_waiting are refused; a draining engine takes none.

No check here depends on how fast the machine is: a test waits for the state it checks (a request paused, aborted,
its blocks freed), never for a number of seconds; the wait's guard only keeps a broken engine from hanging the run."""

from __future__ import annotations

import asyncio
import time

import pytest

from tokenloop.engine.async_engine import AsyncEngine, AsyncEngineConfig, EngineBusy, EngineDraining, RequestFailed
from tokenloop.sampling.params import SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
PROMPT = [5, 6, 7, 8]
HANG_GUARD_S = 120


async def read_all(engine: AsyncEngine, prompt=PROMPT, params=PARAMS):
    out = None
    async for out in engine.generate(prompt, params):
        pass
    return out


async def until(condition, what: str) -> None:
    """Poll until `condition()` holds (the step thread changes the state it reads)."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not condition():
        assert time.monotonic() < deadline, f"never {what} within {HANG_GUARD_S} s"
        await asyncio.sleep(0.01)


def test_a_reader_that_stops_taking_outputs_pauses_its_request_until_it_reads_again(
    make_async_engine, tiny_model_folder
):
    engine = make_async_engine(tiny_model_folder, AsyncEngineConfig(max_unread_outputs=4))
    scheduler = engine.engine.scheduler
    other_params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)

    async def scenario():
        expected = (await read_all(engine)).outputs[0].token_ids
        stream = engine.generate(PROMPT, PARAMS)
        first = await stream.__anext__()
        await until(lambda: scheduler.paused, "paused")  # the reader takes nothing: after 4 outputs, paused
        (paused,) = list(scheduler.paused)
        made = len(paused.output_token_ids)
        # The engine steps on for another request, 20 tokens to its end; the paused one makes no progress meanwhile.
        other = await read_all(engine, [9, 10, 11], other_params)
        still = len(paused.output_token_ids)
        out = first
        async for out in stream:
            pass
        return expected, made, other, still, out

    expected, made, other, still, out = asyncio.run(scenario())
    assert other.finished and len(other.outputs[0].token_ids) == 20
    assert made == still < 200  # paused, its tokens kept, and no progress while paused
    assert out.finished and out.outputs[0].token_ids == expected
    assert engine.engine.block_manager.num_used_blocks == 0 and engine.num_in_flight == 0


def test_a_reader_gone_quiet_past_the_unread_timeout_loses_its_request_and_its_blocks(
    make_async_engine, tiny_model_folder
):
    engine = make_async_engine(tiny_model_folder, AsyncEngineConfig(max_unread_outputs=2, unread_timeout_s=0.5))
    inner = engine.engine

    async def scenario():
        stream = engine.generate(PROMPT, PARAMS)
        await stream.__anext__()
        # The reader takes nothing: its request is paused after 2 outputs, aborted 0.5 s later, its blocks freed.
        await until(lambda: not inner.requests and inner.block_manager.num_used_blocks == 0, "aborted and freed")
        with pytest.raises(RequestFailed, match="read nothing for 0.5 s"):
            async for _ in stream:
                pass

    asyncio.run(scenario())
    assert inner.block_manager.num_used_blocks == 0 and not inner.requests and engine.num_in_flight == 0


def test_requests_beyond_max_waiting_are_refused_and_a_draining_engine_takes_none(make_async_engine, tiny_model_folder):
    engine = make_async_engine(tiny_model_folder, AsyncEngineConfig(max_waiting=2))

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


def test_abort_all_ends_each_stream_with_finish_reason_abort(make_async_engine, tiny_model_folder):
    engine = make_async_engine(tiny_model_folder)

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


def test_health_follows_the_step_loop(make_async_engine, tiny_model_folder):
    """Healthy while the loop runs: after a command that fails (the loop goes on and serves the next request), and
    while it idles (it wakes on its own to keep its heartbeat fresh, each stall_timeout_s / 4); not after shutdown."""
    engine = make_async_engine(tiny_model_folder)
    assert engine.healthy()
    engine._command("add", "stall", None, None)  # not a prompt: the command fails, the loop goes on
    out = asyncio.run(read_all(engine, params=SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)))
    assert out.finished and len(out.outputs[0].token_ids) == 3 and engine.death is None
    beat = engine._heartbeat
    asyncio.run(until(lambda: engine._heartbeat > beat, "a heartbeat of the idle loop"))
    assert not engine.engine.has_unfinished_requests() and engine.healthy()
    engine.shutdown()
    assert not engine.healthy()
