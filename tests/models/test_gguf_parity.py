"""The float32 path on the real default GGUF reproduces transformers loading the same file."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import forward_in_chunks, hf_beams, reference_greedy
from tokenloop import SamplingParams
from tokenloop.bench.parity_prompts import CONVERSATIONS, LONG_PROMPT, prompts
from tokenloop.models.loader import LoadedModel

pytestmark = pytest.mark.real_model

NEW_TOKENS = 32
TOP = 5


def test_chat_template_token_ids_match_transformers(llm_fp32, hf_reference):
    _, hf_tok = hf_reference
    for conversation in CONVERSATIONS:
        expected = hf_tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
        expected = expected["input_ids"] if not isinstance(expected, list) else expected
        assert llm_fp32.chat_prompt(conversation)["prompt_token_ids"] == list(expected)


def test_greedy_tokens_and_logprobs_match_transformers(llm_fp32, hf_reference):
    hf_model, _ = hf_reference
    batch = prompts(llm_fp32)
    assert max(len(p["prompt_token_ids"]) for p in batch) > 2000
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=TOP, ignore_eos=True)
    # The long prompt runs on its own: batched attention pads every sequence to the longest context.
    short = [p for p in batch if len(p["prompt_token_ids"]) <= 2000]
    long = [p for p in batch if len(p["prompt_token_ids"]) > 2000]
    batch = short + long
    outputs = llm_fp32.generate(short, params, use_tqdm=False) + llm_fp32.generate(long, params, use_tqdm=False)
    diverged = []
    for prompt, out in zip(batch, outputs):
        ours = out.outputs[0]
        ref_tokens, ref_logprobs = reference_greedy(hf_model, prompt["prompt_token_ids"], NEW_TOKENS)
        assert len(ours.token_ids) == NEW_TOKENS
        for step, (a, b) in enumerate(zip(ours.token_ids, ref_tokens)):
            ref_top = ref_logprobs[step].topk(TOP).indices.tolist()
            if a != b:
                # vLLM's check_logprobs_close: at the first divergence each token is in the other's top-k; stop there.
                assert a in ref_top and b in ours.logprobs[step], (
                    f"prompt {prompt.get('prompt', '')[:40]!r} step {step}"
                )
                diverged.append(prompt["prompt"][:40])
                break
            assert abs(ours.logprobs[step][a].logprob - float(ref_logprobs[step][a])) < 1e-3
            assert set(ours.logprobs[step]) == set(ref_top) | {a}
    assert len(diverged) <= 1, f"greedy outputs diverged for {diverged}"


def test_parallel_forward_equals_token_by_token_decode(llm_fp32, default_model_path):
    engine = llm_fp32.llm_engine
    loaded = LoadedModel(engine.runner.model, engine.model_config, engine.tokenizer, default_model_path)
    token_ids = engine.tokenizer.encode(LONG_PROMPT)[:64]
    parallel = forward_in_chunks(loaded, token_ids, [64], block_size=16)
    stepwise = forward_in_chunks(loaded, token_ids, [1] * 64, block_size=16)
    torch.testing.assert_close(stepwise, parallel, atol=1e-4, rtol=0)


@pytest.mark.parametrize("control", [{"repetition_penalty": 1.3}, {"no_repeat_ngram_size": 3}])
def test_greedy_tokens_with_a_penalty_match_transformers_generate(llm_fp32, hf_reference, control):
    """transformers' own processors (RepetitionPenaltyLogitsProcessor, NoRepeatNGramLogitsProcessor), prompt
    included, against ours: the same greedy token ids for chat and raw prompts, batched."""
    from transformers import GenerationConfig

    hf_model, _ = hf_reference
    batch = [p for p in prompts(llm_fp32) if len(p["prompt_token_ids"]) <= 2000]
    assert len(batch) >= 6
    # min_tokens as transformers' min_new_tokens: EOS banned throughout, on both sides
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, **control)
    outputs = llm_fp32.generate(batch, params, use_tqdm=False)
    config = GenerationConfig(
        do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=0, **control
    )
    for prompt, out in zip(batch, outputs):
        ids = torch.tensor([prompt["prompt_token_ids"]])
        with torch.no_grad():
            expected = hf_model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)[
                0, ids.shape[1] :
            ].tolist()
        assert out.outputs[0].token_ids == expected, prompt.get("prompt", "")[:40]


def test_beam_search_matches_transformers_generate(llm_fp32, hf_reference):
    """num_beams=4, num_return_sequences=4, length_penalty=1.0, early_stopping=False, 24 new tokens: the same
    four beams in the same order for chat prompts (whose beams can end with <|im_end|>) and raw ones."""
    from tokenloop import BeamSearchParams

    hf_model, _ = hf_reference
    batch = [p for p in prompts(llm_fp32) if len(p["prompt_token_ids"]) <= 2000]
    assert len(batch) >= 6
    eos = llm_fp32.get_tokenizer().eos_token_ids
    outs = llm_fp32.beam_search(batch, BeamSearchParams(beam_width=4, max_tokens=24), use_tqdm=False)
    ended = 0
    for prompt, out in zip(batch, outs):
        expected = hf_beams(hf_model, prompt["prompt_token_ids"], eos, 4, 24, length_penalty=1.0, early_stopping=False)
        assert [c.token_ids for c in out.outputs] == expected, prompt.get("prompt", "")[:40]
        ended += sum(c.finish_reason == "stop" for c in out.outputs)
    assert ended > 0  # some beams ended with EOS: that path was compared too
