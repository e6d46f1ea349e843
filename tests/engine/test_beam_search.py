"""Beam search (tiny model, float32) against transformers' generate(num_beams=...): the same beams in the same
order across widths, length penalties and early stopping; beams are forked sequences, so a beam search inside
a batch of other requests finds the same beams, and every block is freed at the end."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.helpers import hf_beams
from tokenloop import BeamSearchParams, SamplingParams

PROMPTS = ["Hello world", "I'm sure they'll say", "The quick brown fox", "def main():"]


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_folder):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_folder, dtype=torch.float32).eval()


CASES = [(w, lp, es) for w, lp, es in itertools.product([1, 4], [1.0, 2.0], [False, True, "never"])] + [(8, 0.5, False)]


@pytest.mark.parametrize("width, length_penalty, early_stopping", CASES)
def test_beams_match_transformers(tiny_llm, hf_tiny, width, length_penalty, early_stopping):
    tok = tiny_llm.get_tokenizer()
    params = BeamSearchParams(
        beam_width=width, max_tokens=16, length_penalty=length_penalty, early_stopping=early_stopping
    )
    outs = tiny_llm.beam_search(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        expected = hf_beams(
            hf_tiny,
            tok.encode(prompt),
            tok.eos_token_ids,
            width,
            16,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
        )
        assert [c.token_ids for c in out.outputs] == expected, prompt
        assert out.outputs[0].cumulative_logprob <= 0 and out.outputs[0].text == tok.decode(
            out.outputs[0].token_ids, skip_special_tokens=True
        )
    manager = tiny_llm.llm_engine.block_manager
    assert all(b.ref_count == 0 for b in manager.blocks)


def test_a_beam_search_among_other_requests_finds_the_same_beams(tiny_llm):
    params = BeamSearchParams(beam_width=4, max_tokens=16, n=2)
    alone = [c.token_ids for c in tiny_llm.beam_search(PROMPTS[0], params, use_tqdm=False)[0].outputs]
    engine = tiny_llm.llm_engine
    plain = SamplingParams(temperature=0.8, seed=1, max_tokens=20, ignore_eos=True)
    others = [engine.add_request(p, plain) for p in PROMPTS * 3]
    beam = engine.add_request(PROMPTS[0], params)
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    assert [c.token_ids for c in outs[beam].outputs] == alone and len(alone) == 2
    assert all(len(outs[i].outputs[0].token_ids) == 20 for i in others)
    assert all(b.ref_count == 0 for b in engine.block_manager.blocks)


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"beam_width": 0}, "beam_width"),
        ({"beam_width": 65}, "beam_width"),
        ({"beam_width": 2, "n": 3}, "n"),
        ({"beam_width": 2, "early_stopping": "sometimes"}, "early_stopping"),
        ({"beam_width": 2, "max_tokens": 0}, "max_tokens"),
    ],
)
def test_bad_beam_search_params_are_a_value_error_naming_the_field(kw, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        BeamSearchParams(**kw)


def test_a_paused_beam_search_waits_with_its_blocks_and_resumes_to_the_same_beams(tiny_llm):
    params = BeamSearchParams(beam_width=3, max_tokens=10)
    alone = [c.token_ids for c in tiny_llm.beam_search(PROMPTS[0], params, use_tqdm=False)[0].outputs]
    engine = tiny_llm.llm_engine
    beam = engine.add_request(PROMPTS[0], params)
    for _ in range(3):
        engine.step()
    engine.pause_request(beam)
    held = engine.block_manager.num_used_blocks
    assert not engine.has_unfinished_requests() and held > 0 and engine.scheduler.paused
    engine.resume_request(beam)
    outs = [out for _ in range(40) for out in engine.step() if out.finished]
    assert [c.token_ids for c in outs[0].outputs] == alone and engine.block_manager.num_used_blocks == 0
