"""On the default model: greedy tokens with speculation equal those without, token for token, on 50 prompts: in
float32 for both proposers (n-gram lookup; the 4-bit fast path drafting for float32), on the fast path for
n-gram lookup, and inside a batch of 32 where some sequences draft and others do not at each step."""

from __future__ import annotations

import pytest

from tokenloop import LLM, SamplingParams
from tokenloop.bench.speculative_prompts import CODE, GROUNDED, OPEN, PARAGRAPH, QUOTE

SUBJECTS = [
    "a lighthouse",
    "the moon",
    "a red bicycle",
    "coffee",
    "the ocean",
    "a small town",
    "winter",
    "robots",
    "bread",
    "a violin",
]
PROMPTS = (
    GROUNDED
    + OPEN
    + [f"Write two sentences about {s}." for s in SUBJECTS]
    + [f"Repeat this sentence three times: {s.capitalize()} is here, and {s} is near." for s in SUBJECTS]
    + [f"Summarise in one line: {PARAGRAPH[i * 40 : i * 40 + 160]}" for i in range(8)]
    + [f"Continue the list: 1. {s}, 2. {s}s, 3." for s in SUBJECTS[:6]]
    + [f"Explain line {i + 1} of this code:\n{CODE}" for i in range(4)]
    + [f"Who might have written this? {QUOTE[: 60 + 10 * i]}" for i in range(3)]
)[:50]
GREEDY = SamplingParams(temperature=0, max_tokens=20)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}


def chat_tokens(llm: LLM, prompts: list[str]) -> list[list[int]]:
    return [
        o.outputs[0].token_ids
        for o in llm.chat([[{"role": "user", "content": p}] for p in prompts], GREEDY, use_tqdm=False)
    ]


def test_the_fifty_prompts_are_fifty_distinct_token_sequences(llm_fp32):
    """What the model is given: each prompt through its chat template and tokenizer, none the same as another."""
    ids = [tuple(llm_fp32.chat_prompt([{"role": "user", "content": p}])["prompt_token_ids"]) for p in PROMPTS]
    assert len(ids) == len(set(ids)) == 50


@pytest.fixture(scope="module")
def float32_reference(llm_fp32):
    return chat_tokens(llm_fp32, PROMPTS)


@pytest.mark.parametrize(
    "spec",
    [NGRAM, {"method": "draft", "dtype": "auto", "num_speculative_tokens": 6, "adaptive": False}],
    ids=["ngram", "4-bit draft"],
)
def test_float32_greedy_tokens_with_speculation_equal_those_without(default_model_path, float32_reference, spec):
    llm = LLM(
        default_model_path,
        dtype="float32",
        device="cpu",
        speculative_config=spec | ({"model": str(default_model_path)} if spec["method"] == "draft" else {}),
    )
    assert chat_tokens(llm, PROMPTS) == float32_reference
    stats = llm.llm_engine.speculator.stats
    assert stats.num_accepted_tokens > 0.3 * stats.num_draft_tokens > 0


def test_fast_path_greedy_tokens_with_ngram_lookup_equal_those_without(default_model_path):
    plain = LLM(default_model_path, device="cpu")
    spec = LLM(default_model_path, device="cpu", speculative_config=NGRAM)
    assert chat_tokens(spec, PROMPTS) == chat_tokens(plain, PROMPTS)
    batch = PROMPTS[:32]  # at each step some of them draft (a lookup found a match) and the others decode one token
    assert chat_tokens(spec, batch) == chat_tokens(plain, batch)
    assert spec.llm_engine.speculator.stats.num_accepted_tokens > 0
