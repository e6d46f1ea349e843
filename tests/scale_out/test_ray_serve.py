"""`tokenloop serve --replicas 2` and `tokenloop batch` against a real local Ray instance (ray.init() starts a head
on this machine): real replicas, the real request router, Ray Data's actors."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from tests.server.conftest import MODEL_NAME, start_server
from tokenloop import LLM, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.ray]
TENANTS = [f"You are assistant number {t} of the archive. " * 6 for t in range(6)]  # about 80 tokens each


@pytest.fixture(scope="module")
def reference(tiny_model_folder) -> LLM:
    return LLM(tiny_model_folder, dtype="float32", device="cpu", kv_cache_gb=0.01)


@pytest.fixture(scope="module")
def replicas(tiny_model_folder, tmp_path_factory):
    log = tmp_path_factory.mktemp("ray") / "server.log"
    args = ("--replicas", "2", "--router", "prefix", "--kv-cache-gb", "0.01", "--threads", "1", "--no-compile")
    server = start_server(tiny_model_folder, log, *args, startup_timeout=180)
    yield server
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=120) == 0, log.read_text()[-3000:]


def test_the_replicas_give_the_tokens_of_one_engine(replicas, reference):
    client = replicas.client()
    for prompt in ("The quick brown fox", "Hello world! " * 10, "Numbers like 12345"):
        got = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0)
        expected = reference.generate(prompt, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
        assert got.choices[0].text == expected.outputs[0].text
    stream = client.completions.create(model=MODEL_NAME, prompt="Once", max_tokens=12, temperature=0, stream=True)
    assert len([c for c in stream if c.choices and c.choices[0].text]) > 1


def test_the_prefix_router_sends_a_tenant_to_the_replica_holding_its_prompt(replicas):
    client = replicas.client()
    cached = []
    for round_ in range(4):  # every tenant once a round: a router by load alone would scatter them
        for tenant in TENANTS:
            reply = client.completions.create(
                model=MODEL_NAME, prompt=tenant + f"Question {round_}?", max_tokens=2, temperature=0
            )
            cached.append(reply.usage.prompt_tokens_details.cached_tokens)
    later = cached[len(TENANTS) :]
    assert sum(c >= 64 for c in later) >= 0.9 * len(later), str(cached)  # the tenant's blocks were where it went
    metrics = replicas.metrics()
    prompt = metrics["tokenloop_router_prompt_tokens_total"]
    predicted, actual = (metrics[f"tokenloop_router_{k}_hit_tokens_total"] for k in ("predicted", "actual"))
    assert actual > 0.5 * prompt * (len(later) / len(cached)) and abs(predicted - actual) <= 0.05 * prompt


def test_a_batch_on_ray_data_in_order_resumable_with_bad_lines_skipped(tiny_model_folder, reference, tmp_path):
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    prompts = [f"Line {i} says" for i in range(8)]
    lines = [
        json.dumps({"id": f"q{i}", "prompt": p, "sampling_params": {"max_tokens": 8, "temperature": 0}})
        for i, p in enumerate(prompts)
    ]
    lines.insert(3, "{not json")
    lines.insert(6, json.dumps({"id": "bad", "prompt": "x", "sampling_params": {"max_tokens": -1}}))
    source.write_text("\n".join(lines) + "\n")
    target.write_text(json.dumps({"id": "q0", "text": "done before", "token_ids": []}) + "\n" + '{"id": "q1", "te')
    command = [
        sys.executable,
        "-m",
        "tokenloop.cli",
        "batch",
        str(source),
        str(target),
        "--model",
        str(tiny_model_folder),
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--kv-cache-gb",
        "0.01",
        "--replicas",
        "2",
        "--batch-size",
        "2",
        "--no-compile",
    ]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stderr[-3000:]  # two bad lines, reported
    assert "line 4:" in run.stderr and "line 7 (id 'bad')" in run.stderr and "max_tokens" in run.stderr
    rows = [json.loads(line) for line in target.read_text().splitlines()]
    assert [r["id"] for r in rows] == [f"q{i}" for i in range(8)]  # q0 kept, the torn q1 redone, in order
    assert rows[0]["text"] == "done before"
    expected = reference.generate(prompts[1:], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    assert [r["text"] for r in rows[1:]] == [o.outputs[0].text for o in expected]
    again = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert "8 ids done already" in again.stderr and target.read_text().count("\n") == 8
