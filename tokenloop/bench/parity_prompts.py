"""The prompts the float32 path's parity with transformers is tested on (tests/models/test_gguf_parity.py), on the
default model; `tokenloop bench kv` compares the int8 KV cache's greedy tokens with the 16-bit cache's on them."""

from __future__ import annotations

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three primary colours."},
    ],
    [
        {"role": "user", "content": "Hi! Who are you?"},
        {"role": "assistant", "content": "I am SmolLM, a small assistant."},
        {"role": "user", "content": "Write a haiku about the sea."},
    ],
    [{"role": "user", "content": "用一句话介绍一下北京。"}],
]
LONG_PROMPT = (
    " ".join(
        (
            f"Section {i}: the river town of Ashford kept {i * 7 % 23} boats, "
            f"{i * 3 % 11} mills and a bell that rang at dawn."
        )
        for i in range(110)
    )
    + " In summary, the town"
)
RAW_PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "长城是中国古代的军事防御工程，",
    LONG_PROMPT,
]


def prompts(llm) -> list[dict]:
    """The conversations through the model's chat template, then the raw texts, as the engine takes them."""
    chat = [llm.chat_prompt(c) for c in CONVERSATIONS]
    tok = llm.get_tokenizer()
    raw = [{"prompt": p, "prompt_token_ids": tok.encode(p)} for p in RAW_PROMPTS]
    return chat + raw
