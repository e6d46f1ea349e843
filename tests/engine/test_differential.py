"""Differential tests, float32 greedy on the tiny model: the scheduling choices must not change a single token."""

from __future__ import annotations

import pytest

from tokenloop import LLM, SamplingParams

SHARED = "Hello world! Hello tokenizers, hello templates. " * 3
PROMPTS = [SHARED + tail for tail in ("The quick brown fox", "def main():", "Numbers like 12345", "I'm sure")] + [
    "so are emoji 😀 and 中文.",
    "The quick brown fox jumps over the lazy dog." * 2,
]
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_llm):
    return [o.outputs[0].token_ids for o in tiny_llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def make(folder, **engine_args) -> LLM:
    return LLM(folder, **({"dtype": "float32", "device": "cpu", "kv_cache_gb": 0.01} | engine_args))


def test_prefix_caching_off_gives_the_same_tokens(tiny_model_folder, reference):
    llm = make(tiny_model_folder, enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)] == reference


def test_prefix_caching_on_with_shared_prefixes_gives_the_same_tokens(tiny_model_folder, reference):
    llm = make(tiny_model_folder)
    for prompt, expected in zip(PROMPTS, reference):  # one by one, so later prompts hit the shared prefix
        out = llm.generate(prompt, PARAMS, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == expected
    assert llm.llm_engine.block_manager.prefix_hit_tokens > 0


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_gives_the_same_tokens(tiny_model_folder, reference, chunk):
    llm = make(tiny_model_folder, max_num_batched_tokens=chunk)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)] == reference


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix cache", "no prefix cache"])
def test_speculative_decoding_gives_the_same_tokens(tiny_model_folder, reference, method, prefix_caching):
    # Drafts every step (adaptive off); the draft model is the tiny model itself in bfloat16 (close, not equal).
    spec = {"method": method, "num_speculative_tokens": 3, "adaptive": False} | ({"model": str(tiny_model_folder), "dtype": "bfloat16"} if method == "draft" else {})
    llm = make(tiny_model_folder, enable_prefix_caching=prefix_caching, speculative_config=spec)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)] == reference
    assert llm.llm_engine.speculator.stats.num_accepted_tokens > 0


def test_a_request_alone_equals_it_inside_a_batch_of_32(tiny_llm):
    batch = (PROMPTS * 6)[:32]
    together = tiny_llm.generate(batch, PARAMS, use_tqdm=False)
    alone = {p: tiny_llm.generate(p, PARAMS, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS}
    assert [o.outputs[0].token_ids for o in together] == [alone[p] for p in batch]


@pytest.mark.parametrize("engine_args", [{"enable_prefix_caching": False}, {"max_num_batched_tokens": 7}, {}], ids=["no prefix cache", "chunked", "default"])
def test_a_request_failing_beside_the_others_changes_none_of_their_tokens(tiny_model_folder, tiny_llm, reference, engine_args):
    tokenizer = tiny_llm.get_tokenizer()
    marker = max(set(range(400)) - {t for p in PROMPTS for t in tokenizer.encode(p)})  # in no prompt but the victim's
    llm = make(tiny_model_folder, inject_faults=(f"sample:{marker}",), **engine_args)
    engine = llm.llm_engine
    ids = [engine.add_request(p, PARAMS) for p in PROMPTS]
    victim = engine.add_request([5, marker, 6], PARAMS)
    last = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            last[out.request_id] = out
    assert last[victim].error is not None
    assert [last[i].outputs[0].token_ids for i in ids] == reference


PENALIZED = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.5,
                           presence_penalty=0.3, no_repeat_ngram_size=2, logit_bias={7: 2.0}, bad_words=["hello"])


@pytest.fixture(scope="module")
def penalized_reference(tiny_llm):
    return [o.outputs[0].token_ids for o in tiny_llm.generate(PROMPTS, PENALIZED, use_tqdm=False)]


@pytest.mark.parametrize("engine_args", [{"enable_prefix_caching": False}, {"max_num_batched_tokens": 7}, {"kv_blocks": 8}],
                         ids=["no prefix cache", "chunked", "preempted"])
def test_logits_processors_give_the_same_tokens_whatever_the_scheduling(tiny_model_folder, tiny_llm, penalized_reference, engine_args):
    import torch

    from tokenloop.engine.model_runner import kv_bytes_per_block

    if blocks := engine_args.pop("kv_blocks", None):  # a pool too small for the batch: sequences are preempted, recomputed
        engine = tiny_llm.llm_engine
        engine_args["kv_cache_gb"] = blocks * kv_bytes_per_block(engine.model_config, engine.config.block_size, torch.float32) / 2**30
    llm = make(tiny_model_folder, **engine_args)
    outs = llm.generate(PROMPTS, PENALIZED, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == penalized_reference
    if blocks:
        assert llm.llm_engine.scheduler.num_preemptions > 0


def test_logits_processors_alone_equal_them_inside_a_batch_of_32_with_plain_rows(tiny_llm, penalized_reference, reference):
    batch = (PROMPTS * 6)[:32]
    params = [PENALIZED if i % 2 else PARAMS for i in range(32)]
    together = [o.outputs[0].token_ids for o in tiny_llm.generate(batch, params, use_tqdm=False)]
    index = {p: i for i, p in enumerate(PROMPTS)}
    expected = [(penalized_reference if i % 2 else reference)[index[p]] for i, p in enumerate(batch)]
    assert together == expected and penalized_reference != reference


@pytest.mark.parametrize("engine_args", [{"enable_prefix_caching": False}, {"max_num_batched_tokens": 7}, {}], ids=["no prefix cache", "chunked", "default"])
def test_structured_output_gives_the_same_tokens_whatever_the_scheduling(tiny_model_folder, tiny_llm, engine_args):
    from tokenloop.sampling.structured import StructuredOutputsParams

    params = SamplingParams(temperature=0.9, seed=4, max_tokens=24, structured_outputs=StructuredOutputsParams(regex=r"[a-z]{4,12}\."))
    expected = [o.outputs[0].token_ids for o in tiny_llm.generate(PROMPTS, params, use_tqdm=False)]
    outs = make(tiny_model_folder, **engine_args).generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)


SCORED = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=3)


@pytest.fixture(scope="module")
def teacher_forced(tiny_model_folder, tiny_llm):
    """Per prompt: log P(token i | tokens before it), from one forward over the whole prompt."""
    import torch

    from tests.helpers import forward_in_chunks
    from tokenloop.models.loader import load_model

    loaded = load_model(tiny_model_folder, torch.float32, torch.device("cpu"), load_tokenizer=False)
    tokenizer = tiny_llm.get_tokenizer()
    expected = []
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        logprobs = forward_in_chunks(loaded, ids, [len(ids)]).log_softmax(-1)
        expected.append([logprobs[i - 1, t].item() for i, t in enumerate(ids) if i])
    return expected


@pytest.mark.parametrize("engine_args", [{"enable_prefix_caching": False}, {"max_num_batched_tokens": 7}, {"kv_blocks": 8, "max_num_batched_tokens": 16}, {}],
                         ids=["no prefix cache", "chunked", "preempted", "prefix cache warm"])
def test_prompt_logprobs_are_the_teacher_forced_ones_whatever_the_scheduling(tiny_model_folder, tiny_llm, reference, teacher_forced, engine_args):
    import torch

    from tokenloop.engine.model_runner import kv_bytes_per_block

    if blocks := engine_args.pop("kv_blocks", None):
        engine = tiny_llm.llm_engine
        engine_args["kv_cache_gb"] = blocks * kv_bytes_per_block(engine.model_config, engine.config.block_size, torch.float32) / 2**30
    llm = make(tiny_model_folder, **engine_args)
    if not engine_args:  # every prompt already in the prefix cache: scoring must still compute each position
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    batch = (PROMPTS * 6)[:32] if not engine_args else PROMPTS
    params = [SCORED if i % 2 == 0 else PARAMS for i in range(len(batch))]
    outs = llm.generate(batch, params, use_tqdm=False)
    for i, (prompt, out) in enumerate(zip(batch, outs)):
        k = PROMPTS.index(prompt)
        assert out.outputs[0].token_ids == reference[k][:len(out.outputs[0].token_ids)]
        if i % 2:
            assert out.prompt_logprobs is None
            continue
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
        got = [entries[t].logprob for entries, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]
        assert got == pytest.approx(teacher_forced[k], abs=1e-4)
        assert all(3 <= len(entries) <= 4 for entries in out.prompt_logprobs[1:])
    if blocks:
        assert llm.llm_engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("engine_args", [{"enable_prefix_caching": False}, {"max_num_batched_tokens": 7}, {"kv_blocks": 10}],
                         ids=["no prefix cache", "chunked", "preempted"])
def test_forked_completions_and_beams_are_the_same_whatever_the_scheduling(tiny_model_folder, tiny_llm, engine_args):
    import torch

    from tokenloop import BeamSearchParams
    from tokenloop.engine.model_runner import kv_bytes_per_block

    forked = SamplingParams(temperature=1.0, seed=5, max_tokens=16, ignore_eos=True, n=4)
    beams = BeamSearchParams(beam_width=4, max_tokens=12)
    expected = ([[c.token_ids for c in o.outputs] for o in tiny_llm.generate(PROMPTS[:3], forked, use_tqdm=False)],
                [[c.token_ids for c in o.outputs] for o in tiny_llm.beam_search(PROMPTS[:3], beams, use_tqdm=False)])
    if blocks := engine_args.pop("kv_blocks", None):
        engine = tiny_llm.llm_engine
        engine_args["kv_cache_gb"] = blocks * kv_bytes_per_block(engine.model_config, engine.config.block_size, torch.float32) / 2**30
    llm = make(tiny_model_folder, **engine_args)
    got = ([[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS[:3], forked, use_tqdm=False)],
           [[c.token_ids for c in o.outputs] for o in llm.beam_search(PROMPTS[:3], beams, use_tqdm=False)])
    assert got == expected
    if blocks:
        assert llm.llm_engine.scheduler.num_preemptions > 0
    assert all(b.ref_count == 0 for b in llm.llm_engine.block_manager.blocks)


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix cache", "no prefix cache"])
def test_sliding_window_layers_give_a_request_alone_the_tokens_it_gets_inside_a_batch_of_32(tiny_gemma3_folder, prefix_caching):
    """Gemma 3's per-layer windows (8 tokens, the prompts cross several): batch composition, shared prefixes
    and long prompt chunks (attended in window pieces) change no token."""
    llm = make(tiny_gemma3_folder, enable_prefix_caching=prefix_caching)
    batch = (PROMPTS * 6)[:32]
    together = llm.generate(batch, PARAMS, use_tqdm=False)
    alone = {p: llm.generate(p, PARAMS, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS}
    assert [o.outputs[0].token_ids for o in together] == [alone[p] for p in batch]
    window = llm.llm_engine.model_config.sliding_window
    assert min(len(o.prompt_token_ids) for o in together) > window  # every prompt's prefill attends in window pieces
    assert min(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in together) > 2 * window  # decodes cross windows
