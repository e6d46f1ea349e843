"""A request that fails inside the engine fails alone, as a JSON 500 (or an error event in its stream) on a
connection that stays usable; /health turns 503 while the step loop is stuck, and 200 again after. A real
server with faults injected for prompts that hold marker tokens (tokenloop serve --inject-fault)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.client import HTTPConnection

import pytest

from tests.server.conftest import MODEL_NAME, start_server, stop_server

FAULTS = {"prepare": 397, "sample": 398, "detokenize": 399}
STALL = 396


@pytest.fixture(scope="module")
def faulty_server(tiny_model_folder, tmp_path_factory):
    faults = [arg for stage, token in FAULTS.items() for arg in ("--inject-fault", f"{stage}:{token}")]
    s = start_server(
        tiny_model_folder,
        tmp_path_factory.mktemp("faulty") / "server.log",
        "--kv-cache-gb",
        "0.01",
        *faults,
        "--inject-fault",
        f"stall:{STALL}",
    )
    yield s
    stop_server(s)


def prompts_of_31() -> list[list[int]]:
    return [[5 + i, 6 + i, 7 + (i * 3) % 50] for i in range(31)]


async def complete_all(server, prompts, stream: bool):
    """Token ids of each prompt's greedy completion (None for one that failed, with its error)."""
    async with server.async_client() as client:

        async def one(prompt):
            kw = {
                "model": MODEL_NAME,
                "prompt": prompt,
                "max_tokens": 16,
                "temperature": 0,
                "logprobs": 0,
                "extra_body": {"ignore_eos": True},
            }
            try:
                if stream:
                    chunks = [c async for c in await client.completions.create(stream=True, **kw)]
                    return "".join(c.choices[0].text for c in chunks), [
                        t for c in chunks for t in c.choices[0].logprobs.tokens
                    ]
                out = await client.completions.create(**kw)
                return out.choices[0].text, out.choices[0].logprobs.tokens
            except Exception as e:
                return None, e

        return await asyncio.gather(*(one(p) for p in prompts))


@pytest.mark.parametrize("stage", FAULTS)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_request_failing_in_the_engine_fails_alone_among_32(faulty_server, stage, stream):
    expected = asyncio.run(complete_all(faulty_server, prompts_of_31(), stream))  # no marker: no fault
    assert all(text is not None for text, _ in expected)
    prompts = prompts_of_31()
    prompts.insert(5, [5, FAULTS[stage], 9])
    results = asyncio.run(complete_all(faulty_server, prompts, stream))
    (_, error) = results.pop(5)
    assert results == expected
    assert isinstance(error, Exception) and "injected fault" in str(error), error


def test_an_engine_failure_is_a_json_500_on_a_connection_that_stays_usable(faulty_server):
    conn = HTTPConnection("127.0.0.1", faulty_server.port, timeout=30)
    try:
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps({"prompt": [5, FAULTS["sample"]], "max_tokens": 4}),
            {"Content-Type": "application/json"},
        )
        response = conn.getresponse()
        body = json.loads(response.read())
        assert (
            response.status == 500
            and body["error"]["type"] == "internal_server_error"
            and "injected fault" in body["error"]["message"]
        )
        assert not response.will_close
        sock = conn.sock
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps({"prompt": [5, 6], "max_tokens": 4}),
            {"Content-Type": "application/json"},
        )
        ok = conn.getresponse()
        assert ok.status == 200 and json.loads(ok.read())["choices"] and conn.sock is sock
    finally:
        conn.close()


def test_a_streamed_engine_failure_ends_with_an_error_event_and_done(faulty_server):
    with faulty_server.http() as http:
        lines = http.post(
            "/v1/completions", json={"prompt": [5, FAULTS["detokenize"]], "max_tokens": 4, "stream": True}
        ).text.splitlines()
    events = [line[6:] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "injected fault" in json.loads(events[-2])["error"]["message"]


def test_health_is_503_while_the_step_loop_is_stuck_and_200_after(faulty_server):
    """The stall holds the step loop 8 s; /health says 503 once the loop has been silent --stall-timeout (4 s): it
    must say so before the stalled request returns, however long the request took to reach the engine."""
    with faulty_server.http() as http:
        assert http.get("/health").status_code == 200
        with faulty_server.http() as other:
            done = {}
            thread = threading.Thread(
                target=lambda: done.setdefault(
                    "r", other.post("/v1/completions", json={"prompt": [5, STALL], "max_tokens": 2})
                )
            )
            thread.start()
            while (health := http.get("/health")).status_code == 200:
                assert "r" not in done, "/health said 200 all through the stall"
                time.sleep(0.1)
            assert health.status_code == 503 and health.json() == {"status": "stalled"}
            thread.join(30)
        assert done["r"].status_code == 200  # the stalled request itself completes once the loop moves again
        assert http.get("/health").status_code == 200


def test_a_dead_step_loop_ends_every_stream_says_503_and_exits_non_zero(long_context_model_folder, tmp_path):
    """A step thread that dies (injected: an exception no `except Exception` stops) must not leave streams hanging:
    the running stream gets an error event and [DONE], /health answers 503, and the process exits with status 1 so
    that a supervisor restarts it."""
    die = 395
    s = start_server(
        long_context_model_folder, tmp_path / "server.log", "--kv-cache-gb", "0.01", "--inject-fault", f"die:{die}"
    )
    try:
        with s.http() as http, s.http() as other:
            body = {"prompt": [5, 6, 7], "max_tokens": 2000, "stream": True, "ignore_eos": True}
            with other.stream("POST", "/v1/completions", json=body) as running:
                lines = running.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))  # the stream is running
                killer = http.post("/v1/completions", json={"prompt": [5, die], "max_tokens": 2})
                events = [line[6:] for line in lines if line.startswith("data: ")]
            assert killer.status_code == 500 and "step loop died" in killer.json()["error"]["message"]
            assert events[-1] == "[DONE]" and "step loop died" in json.loads(events[-2])["error"]["message"]
            assert http.get("/health").status_code == 503
        assert s.process.wait(timeout=30) == 1
        assert "exiting with status 1" in s.log.read_text()
    finally:
        if s.process.poll() is None:
            s.process.kill()
