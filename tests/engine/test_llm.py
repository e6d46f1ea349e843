"""The offline API end to end on a tiny random model: greedy decoding, batching, seeds, stops, bad input."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import forward_in_chunks
from tokenloop import SamplingParams
from tokenloop.models.loader import LoadedModel

PROMPTS = [
    "The quick brown fox",
    "Hello world! Hello tokenizers, hello templates. " * 3,
    "def main():",
    "Numbers like 12345",
    "I'm sure they'll say",
    "so are emoji 😀 and 中文.",
]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_greedy_output_is_the_argmax_of_a_full_forward_pass(tiny_llm, tiny_model_folder):
    out = tiny_llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)[0]
    engine = tiny_llm.llm_engine
    loaded = LoadedModel(engine.runner.model, engine.model_config, engine.tokenizer, tiny_model_folder)
    tokens = out.prompt_token_ids + out.outputs[0].token_ids
    logits = forward_in_chunks(loaded, tokens, [len(tokens)])
    expected = logits[len(out.prompt_token_ids) - 1 : -1].argmax(-1).tolist()
    assert out.outputs[0].token_ids == expected
    assert out.outputs[0].finish_reason == "length"
    assert out.outputs[0].text == tiny_llm.get_tokenizer().decode(expected, skip_special_tokens=True)


def test_a_request_alone_equals_the_same_request_inside_a_batch(tiny_llm):
    batch = tiny_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, out in zip(PROMPTS, batch):
        alone = tiny_llm.generate(prompt, GREEDY, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids
        assert out.prompt == prompt


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(tiny_llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    first = tiny_llm.generate(PROMPTS[0], seeded, use_tqdm=False)[0].outputs[0].token_ids
    again = tiny_llm.generate(PROMPTS[0], seeded, use_tqdm=False)[0].outputs[0].token_ids
    unseeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    in_batch = tiny_llm.generate([PROMPTS[2], PROMPTS[0], PROMPTS[3]], [unseeded, seeded, unseeded], use_tqdm=False)
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=16, ignore_eos=True)
    assert first == again == in_batch[1].outputs[0].token_ids
    assert tiny_llm.generate(PROMPTS[0], other_seed, use_tqdm=False)[0].outputs[0].token_ids != first


def test_max_tokens_ends_with_length(tiny_llm):
    out = tiny_llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"


def test_stop_token_id_ends_the_output(tiny_llm):
    reference = tiny_llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop_at = next(i for i, t in enumerate(reference) if t not in reference[:i] and i >= 2)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[reference[stop_at]])
    out = tiny_llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == reference[: stop_at + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", reference[stop_at])


def test_eos_ends_the_output_unless_ignored(tiny_llm):
    eos = tiny_llm.get_tokenizer().eos_token_ids
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    reference = tiny_llm.generate(PROMPTS, params, use_tqdm=False)
    hits = [(p, o.outputs[0].token_ids) for p, o in zip(PROMPTS, reference) if set(o.outputs[0].token_ids) & set(eos)]
    if not hits:
        pytest.skip("the tiny model never produced an EOS token in 40 greedy steps")
    prompt, tokens = hits[0]
    out = tiny_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    first_eos = next(i for i, t in enumerate(tokens) if t in eos)
    assert out.token_ids == tokens[: first_eos + 1] and out.finish_reason == "stop" and out.stop_reason is None


def test_stop_string_across_tokens_is_cut_from_the_text(tiny_llm):
    outputs = tiny_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    prompt, text = max(((p, o.outputs[0].text) for p, o in zip(PROMPTS, outputs)), key=lambda pt: len(pt[1]))
    assert len(text) > 8
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])
    out = tiny_llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert out.text == text[: text.index(stop)]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)


def test_logprobs_hold_the_chosen_token_and_the_top_k(tiny_llm):
    params = SamplingParams(temperature=0.8, seed=0, max_tokens=6, logprobs=3, ignore_eos=True)
    out = tiny_llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 6
    for token, entries in zip(out.token_ids, out.logprobs):
        assert token in entries and len(entries) in (3, 4)
        top = sorted((lp for t, lp in entries.items() if lp.rank <= 3), key=lambda lp: lp.rank)
        assert [lp.rank for lp in top] == [1, 2, 3] and top[0].logprob >= top[1].logprob >= top[2].logprob
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))


def test_prefix_cache_serves_a_repeated_prompt(tiny_llm):
    prompt = PROMPTS[1] * 2
    first = tiny_llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    second = tiny_llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    block = tiny_llm.llm_engine.config.block_size
    assert second.num_cached_tokens == (len(second.prompt_token_ids) - 1) // block * block > 0
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_chat_renders_the_template_and_reuses_earlier_turns(tiny_llm):
    conversation = [{"role": "user", "content": PROMPTS[1]}]
    first = tiny_llm.chat(conversation, GREEDY, use_tqdm=False)[0]
    assert first.prompt.startswith("<s><|user|>") and first.prompt.endswith("<|assistant|>")
    conversation += [{"role": "assistant", "content": first.outputs[0].text}, {"role": "user", "content": "And then?"}]
    second = tiny_llm.chat(conversation, GREEDY, use_tqdm=False)[0]
    assert second.num_cached_tokens >= len(first.prompt_token_ids) - tiny_llm.llm_engine.config.block_size


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        (
            "hello",
            SamplingParams(max_tokens=300),
            r"max_tokens is 300: with the prompt's \d+ tokens that makes \d+, beyond the context length of 256 tokens",
        ),
        ("", SamplingParams(), "prompt is empty"),
        ([5, 400, 7], SamplingParams(), r"out of the vocabulary \[0, 400\): \[400\]"),
        ({"text": "x"}, SamplingParams(), "needs 'prompt' or 'prompt_token_ids'"),
        (3.5, SamplingParams(), "a prompt must be"),
    ],
)
def test_bad_prompts_are_value_errors(tiny_llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        tiny_llm.generate(prompt, params, use_tqdm=False)
    assert not tiny_llm.llm_engine.has_unfinished_requests()


def test_one_bad_prompt_runs_nothing(tiny_llm):
    with pytest.raises(ValueError):
        tiny_llm.generate(["fine", ""], GREEDY, use_tqdm=False)
    assert not tiny_llm.llm_engine.has_unfinished_requests()
    assert tiny_llm.llm_engine.block_manager.num_free_blocks == tiny_llm.llm_engine.block_manager.num_blocks


def test_kv_blocks_are_all_free_after_a_run(tiny_llm):
    tiny_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    manager = tiny_llm.llm_engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks
    assert all(block.ref_count == 0 for block in manager.blocks)


def test_the_engine_keeps_no_tensor_state_between_requests(tiny_llm):
    # The same prompt gives the same logprobs after many other requests have used (and evicted) the cache.
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=2, ignore_eos=True)
    before = tiny_llm.generate(PROMPTS[4], params, use_tqdm=False)[0].outputs[0].logprobs
    tiny_llm.generate(PROMPTS * 3, GREEDY, use_tqdm=False)
    after = tiny_llm.generate(PROMPTS[4], params, use_tqdm=False)[0].outputs[0].logprobs
    for a, b in zip(before, after):
        assert a.keys() == b.keys()
        for t in a:
            assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-5)
    assert torch.get_default_dtype() == torch.float32


def test_a_pool_too_small_for_the_batch_preempts_and_loses_nothing(tiny_llm, tiny_model_folder):
    from tokenloop import LLM
    from tokenloop.engine.kv_groups import kv_bytes_per_block

    engine = tiny_llm.llm_engine
    block_bytes = kv_bytes_per_block(engine.model_config, engine.config.block_size, torch.float32)
    small = LLM(tiny_model_folder, dtype="float32", device="cpu", kv_cache_gb=8 * block_bytes / 2**30)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = tiny_llm.generate(PROMPTS, params, use_tqdm=False)
    got = small.generate(PROMPTS, params, use_tqdm=False)
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    manager = small.llm_engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks and all(b.ref_count == 0 for b in manager.blocks)


def test_a_request_larger_than_the_whole_pool_is_refused(tiny_model_folder):
    from tokenloop import LLM

    small = LLM(tiny_model_folder, dtype="float32", device="cpu", kv_cache_gb=2 * 8192 / 2**30)
    with pytest.raises(ValueError, match="the KV cache's size of 32 tokens"):
        small.generate(PROMPTS[1], SamplingParams(max_tokens=30), use_tqdm=False)


def test_n_completions_fork_off_the_first_sharing_its_blocks_and_follow_seed_plus_index(tiny_llm):
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    out = tiny_llm.generate(PROMPTS[1], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished
    for c in out.outputs:
        single = SamplingParams(temperature=1.0, seed=11 + c.index, max_tokens=8, ignore_eos=True)
        assert tiny_llm.generate(PROMPTS[1], single, use_tqdm=False)[0].outputs[0].token_ids == c.token_ids
    engine = tiny_llm.llm_engine
    prompt = PROMPTS[1] * 2
    request_id = engine.add_request(prompt, SamplingParams(n=2, temperature=0, max_tokens=4, ignore_eos=True))
    request = engine.requests[request_id]
    engine.step()  # the prompt's prefill: the second completion forks off the first, sharing its blocks
    first, second = (c.seq for c in request.completions)
    full = len(request.prompt_token_ids) // engine.config.block_size
    assert (
        full > 0
        and second.block_table == first.block_table
        and second.num_computed_tokens == len(request.prompt_token_ids) - 1
    )
    engine.step()  # each wrote into the shared last block: a copy each, the full ones still shared
    assert second.block_table[:full] == first.block_table[:full] and second.block_table[full] != first.block_table[full]
    while engine.has_unfinished_requests():
        engine.step()
    assert first.output_token_ids == second.output_token_ids


def test_abort_frees_every_block_at_once(tiny_llm):
    engine = tiny_llm.llm_engine
    request_id = engine.add_request(PROMPTS[1], SamplingParams(n=2, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    engine.abort_request(request_id)
    assert not engine.has_unfinished_requests() and not engine.requests
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
