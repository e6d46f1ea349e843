"""`tokenloop serve --speculative-config JSON`: the same greedy tokens as a plain server, the request's acceptance in
its usage (streamed too), Prometheus counters of drafts, and a bad config refused at start-up."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.server.conftest import MODEL_NAME, start_server, stop_server

CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "adaptive": False}
PROMPT = "Hello world! Hello tokenizers, hello templates. " * 3


@pytest.fixture(scope="module")
def spec_server(tiny_model_folder, tmp_path_factory):
    s = start_server(
        tiny_model_folder,
        tmp_path_factory.mktemp("spec_server") / "server.log",
        "--kv-cache-gb",
        "0.01",
        "--speculative-config",
        json.dumps(CONFIG),
    )
    yield s
    stop_server(s)


def test_tokens_equal_a_plain_servers_and_usage_says_what_was_accepted(spec_server, client):
    args = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "logprobs": 1}
    plain = client.completions.create(**args)
    out = spec_server.client().completions.create(**args)
    assert out.choices[0].text == plain.choices[0].text
    assert out.choices[0].logprobs.tokens == plain.choices[0].logprobs.tokens
    usage = out.usage.model_extra["speculative_decoding"]
    assert usage["draft_tokens"] > usage["accepted_tokens"] > 0 and usage["drafts"] > 0
    assert usage["acceptance_rate"] == pytest.approx(usage["accepted_tokens"] / usage["draft_tokens"], abs=1e-4)
    assert usage["mean_accepted_length"] == pytest.approx(1 + usage["accepted_tokens"] / usage["drafts"], abs=1e-4)
    assert "speculative_decoding" not in (plain.usage.model_extra or {})  # a plain server has no such field


def test_a_streamed_chat_gets_it_in_its_usage_chunk(spec_server):
    stream = spec_server.client().chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=30,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage.model_extra["speculative_decoding"]["draft_tokens"] > 0


def test_prometheus_counts_drafts_and_accepted_tokens(spec_server):
    spec_server.client().completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=20, temperature=0)
    m = spec_server.metrics()
    assert m["tokenloop_spec_decode_num_draft_tokens_total"] >= m["tokenloop_spec_decode_num_accepted_tokens_total"] > 0
    assert m["tokenloop_spec_decode_num_drafts_total"] > 0 and m["tokenloop_spec_decode_mean_accepted_length"] > 1
    assert "tokenloop_spec_decode_num_accepted_tokens_per_pos_total" in m and "tokenloop_spec_decode_draft_length" in m


@pytest.mark.parametrize(
    "config, message",
    [
        ('{"method": "medusa"}', "speculative_config.method must be one of ngram, draft, eagle"),
        ('{"method": "eagle"}', "speculative_config.model is required for method 'eagle'"),
        (
            '{"method": "ngram", "num_speculative_tokens": 32}',
            r"num_speculative_tokens must be an integer in \[1, 16\]",
        ),
        ("{method: ngram}", "--speculative-config: not JSON"),
    ],
)
def test_a_bad_config_stops_the_server_at_start_up(tiny_model_folder, config, message):
    cmd = [
        sys.executable,
        "-m",
        "tokenloop.cli",
        "serve",
        "--model",
        str(tiny_model_folder),
        "--port",
        "0",
        "--speculative-config",
        config,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert __import__("re").search(message, proc.stderr), proc.stderr
