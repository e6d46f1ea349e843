"""The frontend: a prompt is processed once into a ProcessedPrompt, on the input threads (never the event loop),
and a running request's outputs are snapshots that later steps leave as they were."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from tokenloop.engine.input_processor import ProcessedPrompt
from tokenloop.outputs import Prefix
from tokenloop.sampling.params import SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)


def test_a_processed_prompt_is_checked_once_and_queued_as_it_is(tiny_llm):
    engine = tiny_llm.llm_engine
    processed = engine.input_processor.process("hello world", SamplingParams(temperature=0, max_tokens=None))
    assert isinstance(processed, ProcessedPrompt)
    assert processed.params.max_tokens == engine.max_model_len - len(processed.prompt_token_ids)
    assert processed.prompt_token_ids == engine.tokenizer.encode("hello world")
    with pytest.raises(ValueError, match="carries its own params"):
        engine.add_request(processed, SamplingParams(temperature=1.0))
    with pytest.raises(ValueError, match="prompt has 300 tokens: no room for one more within the context length"):
        engine.input_processor.process([5] * 300, SamplingParams())
    request_id = engine.add_request(processed)
    while engine.has_unfinished_requests():
        engine.step()
    assert request_id not in engine.requests


def test_a_running_requests_outputs_are_snapshots_that_later_steps_leave_unchanged(tiny_llm):
    engine = tiny_llm.llm_engine
    engine.add_request([5, 6, 7, 8], PARAMS)
    seen = []  # (output, what it showed when it came)
    while engine.has_unfinished_requests():
        for out in engine.step():
            c = out.outputs[0]
            seen.append((out, list(c.token_ids), list(c.logprobs), c.text))
    final = seen[-1][0].outputs[0]
    assert len(seen) == 12 and type(final.token_ids) is list and type(final.logprobs) is list
    for i, (out, token_ids, logprobs, text) in enumerate(seen):
        c = out.outputs[0]
        assert (list(c.token_ids), list(c.logprobs), c.text) == (token_ids, logprobs, text)
        assert len(token_ids) == i + 1 and token_ids == final.token_ids[: i + 1]
        assert isinstance(c.token_ids, Prefix) == (i < 11)


def test_prompts_are_processed_on_the_input_threads_at_the_lowest_priority(make_async_engine, tiny_model_folder):
    engine = make_async_engine(tiny_model_folder)
    where = []
    process = engine.inputs.process

    def recording(*args):
        thread = threading.current_thread()
        where.append((thread.name, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        return process(*args)

    engine.inputs.process = recording

    async def scenario():
        loop_thread = threading.current_thread().name
        async for out in engine.generate("hello world", PARAMS):
            pass
        batch = await engine.admit_and_process(["hello", [5, 6, 7]], PARAMS)
        with pytest.raises(ValueError, match="the prompt is empty"):
            await engine.admit_and_process(["hello", ""], PARAMS)
        return loop_thread, out, batch

    loop_thread, out, batch = asyncio.run(scenario())
    assert out.finished and len(out.outputs[0].token_ids) == 12 and len(batch) == 2
    assert len(where) == 5 and all(name.startswith("tokenloop-input") for name, _ in where)
    assert all(name != loop_thread and name != "tokenloop-engine" for name, _ in where)
    assert all(nice == 19 for _, nice in where)
    assert engine.num_waiting == 0
