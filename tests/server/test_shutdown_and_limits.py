"""SIGTERM drains: running streams go on for --shutdown-timeout, then each ends with a last chunk (finish_reason
"abort") and [DONE], and the process exits with status 0 in time. Requests beyond --max-waiting get a 429 with
Retry-After."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import threading
import time

import httpx

from tests.server.conftest import MODEL_NAME, start_server, stop_server
from tests.server.openai_errors import assert_openai_error

SHUTDOWN_TIMEOUT_S = 1.0
HANG_GUARD_S = 60  # only keeps a broken server from hanging the run: no check depends on the machine's speed


def wait_until_draining(server) -> None:
    """Once SIGTERM is handled, the listening socket is closed (or /health says 503 on a connection still open)."""
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        try:
            if httpx.get(f"{server.url}/health", timeout=5).status_code == 503:
                return
        except httpx.TransportError:
            return
        assert time.monotonic() < deadline, f"still serving {HANG_GUARD_S} s after SIGTERM"
        time.sleep(0.05)


def read_stream(url: str, body: dict, events: list, first: threading.Event) -> None:
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first.set()
    except httpx.HTTPError as e:
        events.append(e)
    first.set()


def test_sigterm_with_16_streams_ends_each_with_a_last_chunk_and_done_and_exits_0(long_context_model_folder, tmp_path):
    server = start_server(
        long_context_model_folder,
        tmp_path / "server.log",
        "--kv-cache-gb",
        "0.05",
        "--max-num-seqs",
        "8",
        "--shutdown-timeout",
        str(SHUTDOWN_TIMEOUT_S),
    )
    streams = [([], threading.Event()) for _ in range(16)]
    threads = []
    for i, (events, first) in enumerate(streams):
        body = {
            "model": MODEL_NAME,
            "prompt": [5 + i, 6, 7],
            "max_tokens": 3000,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        threads.append(threading.Thread(target=read_stream, args=(server.url, body, events, first)))
        threads[-1].start()
    for events, first in streams[:8]:  # the first 8 run (the other 8 wait for a seat)
        assert first.wait(30)
    server.process.send_signal(signal.SIGTERM)
    wait_until_draining(server)
    try:
        refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi"}, timeout=5)
        assert refused.status_code == 503
    except httpx.TransportError:
        pass  # the listening socket is closed: refused at once either way
    try:
        code = server.process.wait(timeout=HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        server.process.kill()
        raise AssertionError(f"not exited {HANG_GUARD_S} s after SIGTERM:\n{server.log.read_text()}")
    log = server.log.read_text()
    assert code == 0 and "Finished server process" in log, log
    for t in threads:
        t.join(10)
    reasons = []
    for events, _ in streams:
        assert events and events[-1] == "[DONE]", events[-3:]
        last = json.loads(events[-2])["choices"][0]
        assert last["finish_reason"] in ("abort", "length")
        reasons.append(last["finish_reason"])
    # In time: the server ended the streams at its shutdown timeout, not when they were done (8 at a time, 3,000
    # tokens each), then exited: its timeout's abort came before its exit, and ended each stream still running.
    (ended,) = re.findall(r"shutdown timeout: ending (\d+) requests with finish_reason 'abort'", log)
    assert int(ended) == reasons.count("abort") > 0, (reasons, log)
    assert log.index("shutdown timeout: ending") < log.index("Finished server process")


def test_requests_beyond_max_waiting_get_a_429_with_retry_after(long_context_model_folder, tmp_path):
    server = start_server(
        long_context_model_folder,
        tmp_path / "server.log",
        "--kv-cache-gb",
        "0.05",
        "--max-num-seqs",
        "1",
        "--max-waiting",
        "2",
        "--shutdown-timeout",
        "0.5",
    )
    streams = [([], threading.Event()) for _ in range(3)]
    body = {
        "model": MODEL_NAME,
        "prompt": [5, 6],
        "max_tokens": 4000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    threads = [threading.Thread(target=read_stream, args=(server.url, body, *stream)) for stream in streams]
    try:
        threads[0].start()
        assert streams[0][1].wait(30)  # running: it no longer waits
        for t in threads[1:]:
            t.start()
        # The other two wait behind it (one sequence at a time, 4,000 tokens each).
        deadline = time.monotonic() + HANG_GUARD_S
        while server.metrics()["tokenloop_num_requests_waiting"] < 2:
            assert time.monotonic() < deadline, f"the two requests were not waiting after {HANG_GUARD_S} s"
            time.sleep(0.05)
        response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
        assert_openai_error(response, 429)
        assert int(response.headers["retry-after"]) >= 1
    finally:
        stop_server(server)  # the three streams end with finish_reason "abort" after 0.5 s
    for t in threads:
        t.join(30)
    assert all(events[-1] == "[DONE]" for events, _ in streams)
