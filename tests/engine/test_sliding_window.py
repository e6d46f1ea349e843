"""Per-layer attention windows through the engine, on the tiny Gemma 3 (window 8; five sliding layers, one global):
greedy tokens and their logprobs equal transformers' with prefix caching on and off, with prefill chunks that
cross the window, and with decodes batched beside prefill chunks (decode kernel and SDPA in one step)."""

from __future__ import annotations

import pytest
import torch

from tokenloop import SamplingParams

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 12
_ids = torch.randint(3, 400, (60,), generator=torch.Generator().manual_seed(2)).tolist()
# 40-token prompts sharing their first 32 tokens (two blocks of 16, what prefix caching can share), and a longer one.
PROMPTS = [_ids[:32] + _ids[32 + i : 40 + i] for i in range(3)] + [_ids]
PARAMS = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_gemma3_folder) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy tokens and their logprobs, each step recomputed from the whole sequence."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_gemma3_folder, dtype=torch.float32).eval()
    out = []
    for prompt in PROMPTS:
        ids, tokens, logprobs = list(prompt), [], []
        with torch.no_grad():
            for _ in range(NEW_TOKENS):
                lp = model(torch.tensor([ids])).logits[0, -1].log_softmax(-1)
                tokens.append(int(lp.argmax()))
                logprobs.append(float(lp.max()))
                ids.append(tokens[-1])
        out.append((tokens, logprobs))
    return out


def check(outputs, reference) -> None:
    for out, (tokens, logprobs) in zip(outputs, reference, strict=True):
        ours = out.outputs[0]
        assert ours.token_ids == tokens
        got = [step[token].logprob for step, token in zip(ours.logprobs, ours.token_ids)]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(logprobs), atol=1e-4, rtol=0)


def requests() -> list[dict]:
    return [{"prompt_token_ids": p} for p in PROMPTS]


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no prefix cache", "prefix cache"])
def test_one_by_one_with_and_without_prefix_caching(make_llm, tiny_gemma3_folder, reference, prefix_caching):
    llm = make_llm(tiny_gemma3_folder, enable_prefix_caching=prefix_caching)
    # One by one, so that with caching the later prompts start from the first one's two cached blocks.
    check([llm.generate(r, PARAMS, use_tqdm=False)[0] for r in requests()], reference)
    assert (llm.llm_engine.block_manager.prefix_hit_tokens > 0) == prefix_caching


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_batched_with_decodes(make_llm, tiny_gemma3_folder, reference, chunk):
    """All prompts in one batch: their chunks share steps with the decodes of the ones that are done."""
    check(
        make_llm(tiny_gemma3_folder, max_num_batched_tokens=chunk).generate(requests(), PARAMS, use_tqdm=False),
        reference,
    )


def test_preempted_and_recomputed(make_llm, tiny_gemma3_folder, reference):
    """A pool too small for the batch: sequences are preempted and their windows recomputed."""
    llm = make_llm(tiny_gemma3_folder, kv_blocks=5)  # the longest prompt takes 4 blocks of each layer: two cannot
    check(llm.generate(requests(), PARAMS, use_tqdm=False), reference)
    assert llm.llm_engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_decoding_verifies_across_the_window(make_llm, tiny_gemma3_folder, reference, method):
    """Drafts every step (adaptive off): verify rows of one sequence attend through their own windows. The draft
    model is the tiny Gemma itself in bfloat16 (close, not equal)."""
    spec = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    if method == "draft":
        spec |= {"model": str(tiny_gemma3_folder), "dtype": "bfloat16"}
    llm = make_llm(tiny_gemma3_folder, speculative_config=spec)
    check(llm.generate(requests(), PARAMS, use_tqdm=False), reference)
    assert llm.llm_engine.speculator.stats.num_accepted_tokens > 0


def test_sliding_layers_give_back_their_blocks_and_a_long_sequence_fits_a_small_pool(make_llm, tiny_gemma3_folder):
    """The 60-token prompt and 40 greedy tokens, 16 tokens a step, in 36 one-layer blocks (6 per layer): the full
    layer holds 7 and each of the 5 sliding layers (their own KV cache groups) its window, where holding every block
    in every group would take 42. The tokens are a roomy pool's, nothing preempted."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    small = make_llm(tiny_gemma3_folder, kv_blocks=6, max_num_batched_tokens=16)
    roomy = make_llm(tiny_gemma3_folder)
    prompt = {"prompt_token_ids": _ids}
    [got], [want] = small.generate(prompt, params, use_tqdm=False), roomy.generate(prompt, params, use_tqdm=False)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    engine = small.llm_engine
    assert engine.scheduler.num_preemptions == 0
    # 99 tokens computed: each sliding group gave back the blocks of positions before 99 - 8 - 16 + 1 = 76.
    assert engine.block_manager.num_released_blocks == 5 * (76 // 16)
