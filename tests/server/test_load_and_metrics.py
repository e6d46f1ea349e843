"""Many streams at once on a KV pool too small for all of them, clients that leave early, and GET /metrics."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.server.conftest import MODEL_NAME

LATENCY_HISTOGRAMS = (
    "tokenloop_time_to_first_token_seconds",
    "tokenloop_inter_token_latency_seconds",
    "tokenloop_e2e_request_latency_seconds",
)
GAUGES = (
    "tokenloop_num_requests_running",
    "tokenloop_num_requests_waiting",
    "tokenloop_kv_cache_blocks_in_use",
    "tokenloop_kv_cache_blocks_total",
    "tokenloop_prefix_cache_hit_rate",
)
COUNTERS = ("tokenloop_prompt_tokens_total", "tokenloop_generation_tokens_total", "tokenloop_num_preemptions_total")


def wait_until_idle(server, timeout_s: float = 15) -> dict[str, float]:
    """Poll /metrics until no request runs or waits and no KV block is held; fails after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        idle = (
            m["tokenloop_num_requests_running"]
            == m["tokenloop_num_requests_waiting"]
            == m["tokenloop_kv_cache_blocks_in_use"]
            == 0
        )
        if idle:
            return m
        assert time.monotonic() < deadline, f"still busy after {timeout_s} s: {m}"
        time.sleep(0.05)


# Long enough that the 32 streams run together whatever the admission's pace (16 tokens on the tiny model could
# finish the first before the last arrived, and nothing was preempted).
STREAM_TOKENS = 48


def test_32_concurrent_streams_all_complete_even_with_preemption(server, client):
    prompts = [f"Request {i}: the quick brown fox" for i in range(32)]
    before = server.metrics()

    async def one(aclient, prompt):
        stream = await aclient.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=STREAM_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = [c async for c in stream]
        return (
            "".join(c.choices[0].text for c in chunks if c.choices),
            chunks[-2].choices[0].finish_reason,
            chunks[-1].usage,
        )

    async def all_at_once():
        async with server.async_client() as aclient:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))

    results = asyncio.run(all_at_once())
    for text, finish_reason, usage in results:
        assert finish_reason == "length" and usage.completion_tokens == STREAM_TOKENS
    after = wait_until_idle(server)
    # 32 requests need at least 4 KV blocks each by their last token; the pool has fewer than 64: some were preempted.
    assert after["tokenloop_kv_cache_blocks_total"] < 64
    assert after["tokenloop_num_preemptions_total"] > before["tokenloop_num_preemptions_total"]
    # Batched, preempted and recomputed, each stream still says what the request alone says.
    alone = [
        client.completions.create(
            model=MODEL_NAME, prompt=p, max_tokens=STREAM_TOKENS, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
        for p in prompts
    ]
    assert [text for text, _, _ in results] == alone


def test_client_leaving_a_stream_aborts_its_request_and_frees_its_blocks(server):
    before = wait_until_idle(server)
    body = {
        "model": MODEL_NAME,
        "prompt": "Hello world",
        "max_tokens": 200,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(base_url=server.url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            events = 0
            for line in response.iter_lines():
                events += line.startswith("data:")
                if events == 2:
                    assert server.metrics()["tokenloop_kv_cache_blocks_in_use"] > 0  # in flight
                if events == 3:
                    break
            response.close()
    after = wait_until_idle(server)
    # Aborted, not finished: no end-to-end latency recorded, fewer than max_tokens generated.
    assert after["tokenloop_e2e_request_latency_seconds_count"] == before["tokenloop_e2e_request_latency_seconds_count"]
    assert after["tokenloop_generation_tokens_total"] - before["tokenloop_generation_tokens_total"] < 200


@pytest.mark.parametrize("which", ["server", "keyed_server"])  # with and without the API-key middleware
def test_client_timing_out_on_a_non_streamed_request_aborts_it(which, request):
    server = request.getfixturevalue(which)
    before = wait_until_idle(server)
    # 128 x 250 tokens take seconds (32 x 250 ran in 0.4 s on a fast machine, before the first check); the server
    # checks for a gone client every 0.5 s.
    body = {
        "model": MODEL_NAME,
        "prompt": "Hello world",
        "max_tokens": 250,
        "n": 128,
        "temperature": 1,
        "ignore_eos": True,
    }
    with server.http() as http:
        try:
            http.post("/v1/completions", json=body, timeout=0.3)
            raise AssertionError("the request finished before the client's timeout; make it longer")
        except httpx.ReadTimeout:
            pass
    after = wait_until_idle(server)
    assert after["tokenloop_e2e_request_latency_seconds_count"] == before["tokenloop_e2e_request_latency_seconds_count"]
    assert after["tokenloop_generation_tokens_total"] - before["tokenloop_generation_tokens_total"] < 128 * 250


def test_metrics_count_tokens_latencies_and_prefix_cache_hits(server, client, hf_tokenizer):
    prompt = (
        "The quick brown fox jumps over the lazy dog. " * 4
    )  # several full KV blocks: a prefix-cache hit the second time
    n_prompt = len(hf_tokenizer.encode(prompt))
    assert n_prompt >= 32
    before = wait_until_idle(server)
    outs = [
        client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
        )
        for _ in range(2)
    ]
    assert outs[1].usage.prompt_tokens_details.cached_tokens >= 16
    after = wait_until_idle(server)

    def delta(name):
        return after[name] - before[name]

    assert delta("tokenloop_prompt_tokens_total") == 2 * n_prompt
    assert delta("tokenloop_generation_tokens_total") == 2 * 5
    assert delta("tokenloop_time_to_first_token_seconds_count") == 2
    assert delta("tokenloop_inter_token_latency_seconds_count") == 2 * 4
    assert delta("tokenloop_e2e_request_latency_seconds_count") == 2
    assert delta("tokenloop_e2e_request_latency_seconds_sum") > 0
    assert after["tokenloop_prefix_cache_hit_rate"] > 0
    for name in (
        GAUGES + COUNTERS + tuple(f"{h}_{part}" for h in LATENCY_HISTOGRAMS for part in ("count", "sum", "bucket"))
    ):
        assert name in after, name


def test_metrics_are_served_in_the_prometheus_text_format(server):
    response = httpx.get(f"{server.url}/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    assert "# TYPE tokenloop_time_to_first_token_seconds histogram" in response.text
