"""`tokenloop serve --disaggregate` under real clients: the OpenAI SDK streams through a prefill and a decode worker
process; /health names the workers, /metrics shows the handoffs and each worker's engine; SIGTERM drains them all
(stop_server checks the exit). On SmolLM2 (real_model tier) its tokens are colocated serving's."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, start_server, stop_server
from tokenloop import LLM, SamplingParams

SYSTEM = "You are a careful assistant. Answer in plain words, and keep each answer short and to the point. " * 3


@pytest.fixture(scope="module")
def disaggregated_server(tiny_model_folder, tmp_path_factory):
    server = start_server(
        tiny_model_folder, tmp_path_factory.mktemp("pd") / "server.log", "--disaggregate", "--min-prefill-tokens", "17"
    )
    yield server
    stop_server(server)


def test_the_openai_client_streams_through_the_workers(disaggregated_server, tiny_model_folder):
    client = disaggregated_server.client()
    prompt = "The quick brown fox jumps over the lazy dog. " * 6
    kwargs = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 16, "temperature": 0}
    whole = client.completions.create(**kwargs)
    pieces = [c.choices[0].text for c in client.completions.create(**kwargs, stream=True)]
    assert len(pieces) > 2 and "".join(pieces) == whole.choices[0].text
    assert whole.usage.prompt_tokens_details.cached_tokens >= 16  # blocks from the prefill worker
    expected = LLM(tiny_model_folder, dtype="float32", device="cpu", kv_cache_gb=0.01).generate(
        prompt, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False
    )[0]
    assert whole.choices[0].text == expected.outputs[0].text
    health = httpx.get(f"{disaggregated_server.url}/health").json()
    assert health == {"status": "ok", "workers": {"prefill-0": "up", "decode-0": "up"}}
    metrics = httpx.get(f"{disaggregated_server.url}/metrics").text
    assert "tokenloop_pd_handoff_seconds_bucket" in metrics and "tokenloop_pd_handoff_megabytes_total" in metrics
    assert 'tokenloop_kv_cache_blocks_total{worker="decode-0"}' in metrics
    assert 'tokenloop_pd_worker_requests{worker="prefill-0"}' in metrics


@pytest.mark.real_model
def test_smollm2_through_the_workers_gives_colocated_tokens(tmp_path, default_model_path):
    server = start_server(
        default_model_path, tmp_path / "server.log", "--disaggregate", "--dtype", "auto", "--min-prefill-tokens", "64"
    )
    try:
        client = server.client()
        questions = ["Why is the sky blue?", "Name three rivers.", "Write a haiku about bread.", "What is 12 * 7?"]
        requests = [(q, temperature, seed) for q in questions for temperature, seed in ((0, None), (0.8, 3))]
        got = [
            client.chat.completions.create(
                model=MODEL_NAME,
                messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                max_tokens=32,
                temperature=temperature,
                seed=seed,
            )
            .choices[0]
            .message.content
            for q, temperature, seed in requests
        ]
    finally:
        stop_server(server)
    llm = LLM(default_model_path, compile=False)
    expected = [
        llm.chat(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
            SamplingParams(temperature=temperature, seed=seed, max_tokens=32),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .text
        for q, temperature, seed in requests
    ]
    assert got == expected
