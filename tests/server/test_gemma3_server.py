"""`tokenloop serve` on the real Gemma 3 270M (Q4_K_M, the fast path, eager) talked to with the `openai` client:
a chat completion through Gemma's builtin chat template, a stream that reassembles to the non-streamed greedy
text, a prompt longer than the 512-token sliding window answered with the tokens and logprobs the offline LLM
gives it, and /metrics counting the KV blocks sliding layers give back once they fall behind their window.

The server's replies equal the offline engine's cold run token for token and logprob for logprob, bit for bit,
before and after the prefix cache serves most of the prompt: a request's floats do not depend on how its prefill
was split, nor on what ran beside it."""

from __future__ import annotations

import pytest

from tests.server.conftest import start_server, stop_server
from tokenloop import LLM, SamplingParams

pytestmark = pytest.mark.real_model

NAME = "gemma3-270m"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
# Gemma's own template (tokenizer/builtin_templates.py: the file carries none).
CHAT_TEXT = "<bos><start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n"


def long_prompt(first: int) -> str:
    """About 635 tokens: more than the 512-token window, and some whole 16-token blocks beyond it."""
    return (
        " ".join(
            (
                f"Section {i}: the river town of Ashford kept {i * 7 % 23} boats, "
                f"{i * 3 % 11} mills and a bell that rang at dawn."
            )
            for i in range(first, first + 24)
        )
        + " In summary, the town"
    )


@pytest.fixture(scope="module")
def server(gemma3_path, tmp_path_factory):
    s = start_server(
        gemma3_path,
        tmp_path_factory.mktemp("gemma3_server") / "server.log",
        "--served-model-name",
        NAME,
        "--dtype",
        "auto",
        "--no-compile",
        "--kv-cache-gb",
        "0.1",
    )
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def offline(gemma3_path) -> LLM:
    return LLM(gemma3_path, compile=False, device="cpu", kv_cache_gb=0.1)


def test_a_chat_completion_renders_gemmas_builtin_template(server, offline):
    prompt = offline.chat_prompt(CHAT)
    assert prompt["prompt"] == CHAT_TEXT
    expected = offline.chat(CHAT, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    reply = server.client().chat.completions.create(model=NAME, messages=CHAT, temperature=0, max_tokens=24)
    assert reply.model == NAME and reply.choices[0].message.role == "assistant"
    assert reply.usage.prompt_tokens == len(prompt["prompt_token_ids"])
    assert reply.choices[0].message.content == expected.text != ""  # the base model's reply: not an answer
    assert reply.usage.completion_tokens == len(expected.token_ids)


def test_a_streamed_completion_reassembles_to_the_greedy_text(server, offline):
    params = dict(model=NAME, prompt="The capital of France is", temperature=0, max_tokens=24)
    expected = offline.generate(params["prompt"], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[
        0
    ].outputs[0]
    whole = server.client().completions.create(**params)
    chunks = list(server.client().completions.create(**params, stream=True))
    deltas = [c.choices[0].text for c in chunks if c.choices]
    assert len([d for d in deltas if d]) > 1
    assert "".join(deltas) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "length"
    assert whole.choices[0].text == expected.text


def test_a_prompt_longer_than_the_window_gets_the_offline_tokens_before_and_after_a_prefix_hit(server, offline):
    prompt, new = long_prompt(0), 16
    client = server.client()
    expected = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=new, logprobs=0), use_tqdm=False)[0]
    c = expected.outputs[0]
    assert expected.num_cached_tokens == 0
    for run in ("first", "prefix cache hit"):
        reply = client.completions.create(model=NAME, prompt=prompt, temperature=0, max_tokens=new, logprobs=0)
        assert reply.usage.prompt_tokens == len(expected.prompt_token_ids) > 512 + 16
        assert reply.usage.prompt_tokens_details.cached_tokens == (0 if run == "first" else 624), run
        got = reply.choices[0].logprobs
        assert got.tokens == [step[t].decoded_token for step, t in zip(c.logprobs, c.token_ids)], run
        assert got.token_logprobs == [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)], run
        assert reply.choices[0].text == c.text


def test_metrics_count_the_blocks_sliding_layers_give_back_while_a_long_prompt_runs(server, offline):
    """Read while the request decodes. Each of the 5 groups of sliding layers (15 of 18 layers) gives back the
    blocks wholly more than 512 positions and one block behind the newest computed token; the full layers keep
    theirs."""
    prompt_tokens = len(offline.get_tokenizer().encode(long_prompt(24)))
    name = "tokenloop_kv_cache_window_released_blocks_total"
    before = server.metrics()[name]
    stream = server.client().completions.create(
        model=NAME, prompt=long_prompt(24), temperature=0, max_tokens=64, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = iter(stream)
    # Two tokens in: the server reads the engine's state after delivering a step's tokens, so the state after the
    # first step (the prompt computed, the request running) is in the counter by now, and 62 steps are still to run.
    next(chunks), next(chunks)
    released = server.metrics()[name] - before
    for _ in chunks:
        pass
    block_size, window = offline.llm_engine.config.block_size, 512
    computed = range(prompt_tokens, prompt_tokens + 65)
    assert released > 0 and released in {5 * ((n - window - block_size + 1) // block_size) for n in computed}
