"""Structured output in the engine (tiny model): outputs match their grammar and end with EOS, alone and inside a
batch of 32 with plain rows, after preemption, and a spec that cannot be honoured is a ValueError naming it."""

from __future__ import annotations

import re

import pytest
import torch

from tokenloop import LLM, SamplingParams
from tokenloop.engine.output_processor import DEAD_END
from tokenloop.sampling.structured import StructuredOutputsParams

REGEX = r"[0-9]{2}-[a-c]{2,4}"


def constrained(bans: dict | None = None, **spec) -> SamplingParams:
    return SamplingParams(
        temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(**spec), **(bans or {})
    )


def test_outputs_match_the_grammar_and_end(tiny_llm):
    outs = tiny_llm.generate(
        ["Hello", "Hello", "Hi"],
        [constrained(regex=REGEX), constrained(choice=["yes", "no"]), constrained(grammar='start: "<" /[xy]{3}/ ">"')],
        use_tqdm=False,
    )
    texts = [o.outputs[0].text for o in outs]
    assert re.fullmatch(REGEX, texts[0]) and texts[1] in {"yes", "no"} and re.fullmatch(r"<[xy]{3}>", texts[2])
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)


def test_a_structured_row_alone_equals_it_in_a_batch_of_32_and_after_preemption(tiny_llm, tiny_model_folder):
    from tokenloop.engine.kv_groups import kv_bytes_per_block

    params = SamplingParams(
        temperature=0.9, seed=11, max_tokens=24, structured_outputs=StructuredOutputsParams(regex=r"[a-z ]{10,20}\.")
    )
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = tiny_llm.generate("Hello world", params, use_tqdm=False)[0].outputs[0].token_ids
    prompts = ["Hello world", "The quick brown fox jumps over the lazy dog"] * 16
    together = tiny_llm.generate(prompts, [params if i % 2 == 0 else plain for i in range(32)], use_tqdm=False)
    assert all(o.outputs[0].token_ids == alone for o in together[::2])
    engine = tiny_llm.llm_engine
    small = LLM(
        tiny_model_folder,
        dtype="float32",
        device="cpu",
        kv_cache_gb=6 * kv_bytes_per_block(engine.model_config, engine.config.block_size, torch.float32) / 2**30,
    )
    outs = small.generate(prompts[:8], [params if i % 2 == 0 else plain for i in range(8)], use_tqdm=False)
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert all(o.outputs[0].token_ids == alone for o in outs[::2])


@pytest.mark.parametrize(
    "spec, field",
    [
        ({"regex": "("}, "structured_outputs.regex"),
        ({"grammar": "start: nothing_defined"}, "structured_outputs.grammar"),
        (
            {"json": {"type": "object", "properties": {"a": {"type": "string", "format": "no-such-format"}}}},
            "structured_outputs.json",
        ),
    ],
)
def test_a_spec_that_cannot_be_honoured_is_a_value_error_naming_it(tiny_llm, spec, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        tiny_llm.generate("Hello", constrained(**spec), use_tqdm=False)
    assert not tiny_llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("kwargs", [{}, {"regex": "a", "choice": ["b"]}, {"choice": []}, {"json": "{not json"}])
def test_structured_outputs_params_take_exactly_one_valid_spec(kwargs):
    with pytest.raises(ValueError, match="structured_outputs"):
        StructuredOutputsParams(**kwargs)


def test_token_bans_intersect_the_grammar(tiny_llm):
    """A ban removes tokens from the grammar's allowed set, step by step: of "xyz" and "uvw", allowing no token
    with an "x" leaves "uvw"; of "x" and "y" (one token each, one way to spell them), the bad word "x" leaves "y"."""
    tokenizer = tiny_llm.get_tokenizer()
    no_x = [t for t in range(tiny_llm.llm_engine.model_config.vocab_size) if "x" not in tokenizer.decode([t])]
    for ban, choice, left in (
        ({"allowed_token_ids": no_x}, ["xyz", "uvw"], "uvw"),
        ({"bad_words": ["x"]}, ["x", "y"], "y"),
    ):
        out = tiny_llm.generate("Hello", constrained(ban, choice=choice), use_tqdm=False)[0].outputs[0]
        assert (out.text, out.finish_reason, out.stop_reason) == (left, "stop", None), ban


@pytest.mark.parametrize("ban", ["allowed_token_ids", "min_tokens"])
def test_a_grammar_the_bans_leave_no_token_ends_the_request_saying_so(tiny_llm, ban):
    """Where nothing is left (the grammar needs a banned token, or is complete while min_tokens bans EOS), the
    request ends there with finish_reason "stop" and a stop_reason that says why, never a token outside both."""
    tokenizer = tiny_llm.get_tokenizer()
    only = tokenizer.encode("banana")[0]
    params = {"allowed_token_ids": [only]} if ban == "allowed_token_ids" else {"min_tokens": 10}
    out = tiny_llm.generate("Hello", constrained(params, choice=["apple"]), use_tqdm=False)[0].outputs[0]
    assert out.text == ("" if ban == "allowed_token_ids" else "apple")
    assert out.finish_reason == "stop" and out.stop_reason == DEAD_END
    assert not tiny_llm.llm_engine.has_unfinished_requests()
