"""The float32 path on the real Gemma 3 270M GGUF (Q4_K_M, dequantized) reproduces transformers loading the same
file: greedy tokens and logprobs, a 1,600-token prompt across the 512-token window included; the tokenizer's ids
and the chat template's."""

from __future__ import annotations

import pytest

from tests.helpers import reference_greedy, transformers_from_gguf
from tokenloop import LLM, SamplingParams
from tokenloop.tokenizer.builtin_templates import GEMMA3_CHAT_TEMPLATE

pytestmark = pytest.mark.real_model

NEW_TOKENS = 32
TOP = 5

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three primary colours."},
    ],
    [
        {"role": "user", "content": "Hi! Who are you?"},
        {"role": "assistant", "content": "I am Gemma, a small assistant."},
        {"role": "user", "content": "Write a haiku about the sea."},
    ],
]
LONG_PROMPT = (
    " ".join(
        (
            f"Section {i}: the river town of Ashford kept {i * 7 % 23} boats, "
            f"{i * 3 % 11} mills and a bell that rang at dawn."
        )
        for i in range(60)
    )
    + " In summary, the town"
)
RAW_PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "长城是中国古代的军事防御工程，",
    "Numbers  like 12345 and 3.14,\n\n  spaced\tout 😀",
    LONG_PROMPT,
]


@pytest.fixture(scope="module")
def gemma3_fp32(gemma3_path):
    return LLM(gemma3_path, dtype="float32", device="cpu", kv_cache_gb=0.1)


@pytest.fixture(scope="module")
def gemma3_reference(gemma3_path):
    model, tokenizer = transformers_from_gguf(gemma3_path)
    tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE  # the file has none; ours falls back to the same text
    return model, tokenizer


def test_token_ids_match_transformers(gemma3_fp32, gemma3_reference):
    _, hf_tok = gemma3_reference
    for text in RAW_PROMPTS:
        assert gemma3_fp32.get_tokenizer().encode(text) == hf_tok(text).input_ids, text[:40]


def test_chat_template_token_ids_match_transformers(gemma3_fp32, gemma3_reference):
    _, hf_tok = gemma3_reference
    for conversation in CONVERSATIONS:
        expected = hf_tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
        expected = expected["input_ids"] if not isinstance(expected, list) else expected
        assert gemma3_fp32.chat_prompt(conversation)["prompt_token_ids"] == list(expected)


def test_greedy_tokens_and_logprobs_match_transformers(gemma3_fp32, gemma3_reference):
    hf_model, _ = gemma3_reference
    tok = gemma3_fp32.get_tokenizer()
    batch = [gemma3_fp32.chat_prompt(c) for c in CONVERSATIONS] + [
        {"prompt": p, "prompt_token_ids": tok.encode(p)} for p in RAW_PROMPTS
    ]
    assert max(len(p["prompt_token_ids"]) for p in batch) > 1500  # past the 512-token window, and three of its blocks
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=TOP, ignore_eos=True)
    # The long prompt runs on its own: batched attention pads every sequence to the longest context.
    batch = [p for p in batch if len(p["prompt_token_ids"]) <= 1500] + [
        p for p in batch if len(p["prompt_token_ids"]) > 1500
    ]
    outputs = gemma3_fp32.generate(batch[:-1], params, use_tqdm=False) + gemma3_fp32.generate(
        batch[-1:], params, use_tqdm=False
    )
    diverged = []
    for prompt, out in zip(batch, outputs, strict=True):
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
                diverged.append(prompt.get("prompt", "")[:40])
                break
            assert abs(ours.logprobs[step][a].logprob - float(ref_logprobs[step][a])) < 1e-3
            assert set(ours.logprobs[step]) == set(ref_top) | {a}
    assert len(diverged) <= 1, f"greedy outputs diverged for {diverged}"
