"""A client reading 256 bytes/s holds its request's output in the socket, not in server memory: once its reader
lags, the request is paused (its KV blocks kept) until the reader catches up, the other streams run at their
own pace (whole rounds of them, every token, while the reader is slow), and the slow request's text, once read, is
what the same request read at full speed gives."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest

from tests.server.conftest import MODEL_NAME, server_pid_rss_mb, start_server, stop_server

SLOW_BYTES_PER_S = 256
SLOW_FOR_S = 60
SLOW_BODY = {
    "model": MODEL_NAME,
    "prompt": [5, 6, 7],
    "max_tokens": 4000,
    "temperature": 0,
    "ignore_eos": True,
    "stream": True,
}


@pytest.fixture(scope="module")
def long_server(long_context_model_folder, tmp_path_factory):
    # A small KV pool (1,280 blocks): pages of the pool that a run touches become resident, and a large one would
    # grow the RSS by what the cache holds, not by what the server buffers.
    s = start_server(
        long_context_model_folder,
        tmp_path_factory.mktemp("long") / "server.log",
        "--kv-cache-gb",
        "0.01",
        "--shutdown-timeout",
        "5",
    )
    yield s
    stop_server(s)


def sse_text(raw: bytes) -> str:
    """The completion text of a raw chunked SSE response (headers included)."""
    body = raw.split(b"\r\n\r\n", 1)[1]
    decoded, rest = b"", body
    while rest:  # undo the chunked transfer encoding
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        decoded, rest = decoded + rest[:n], rest[n + 2 :]
    events = [line[6:] for line in decoded.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"])


def open_slow_stream(server) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server's writes back up
    sock.connect(("127.0.0.1", server.port))
    body = json.dumps(SLOW_BODY).encode()
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
    )
    return sock


def read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


async def rounds_of_16_streams(server, until: threading.Event, max_tokens: int = 200) -> int:
    """Rounds of 16 concurrent streams, one after another until `until`: how many ended before it, each stream of
    each round with all its `max_tokens` tokens (the server's usage)."""
    rounds = 0
    async with server.async_client() as client:

        async def one(i) -> int:
            stream = await client.completions.create(
                model=MODEL_NAME,
                prompt=[10 + i, 11],
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            return [chunk async for chunk in stream][-1].usage.completion_tokens

        while not until.is_set():
            tokens = await asyncio.gather(*(one(i) for i in range(16)))
            assert tokens == [max_tokens] * 16, tokens
            rounds += not until.is_set()
    return rounds


@pytest.mark.slow  # a minute: the reader is slow on purpose
def test_a_256_bytes_per_second_reader_costs_no_memory_and_no_one_else_any_speed(long_server):
    full_speed_raw = read_all(open_slow_stream(long_server))
    full_speed = sse_text(full_speed_raw)
    rss_before = server_pid_rss_mb(long_server)

    sock = open_slow_stream(long_server)
    try:
        slow, received, peak_rss, paused_seen, rounds, preempted = read_slowly(long_server, sock, rss_before)
    finally:
        sock.close()
    # The slow phase ended with the stream far from over: the server held the rest back (its request paused).
    assert b"[DONE]" not in received and len(received) < len(full_speed_raw) / 10
    assert paused_seen == 1  # its output backed up to the server, which paused the request
    assert peak_rss - rss_before < 50, (rss_before, peak_rss)
    # No one else's speed, counted in tokens and steps, not seconds: while the request waited on its reader (its
    # blocks held), the 16 others ran whole rounds, every token, and none of them was preempted for it.
    assert rounds >= 1 and preempted == 0
    assert slow == full_speed and len(full_speed) > 1000


def read_slowly(long_server, sock: socket.socket, rss_before: float):
    """Read the stream at 256 bytes/s for 60 s while rounds of 16 other streams run, then the rest at full speed."""
    received, peak_rss, paused_seen = b"", rss_before, 0.0
    others, slow_phase_over = {}, threading.Event()
    thread = threading.Thread(
        target=lambda: others.setdefault("rounds", asyncio.run(rounds_of_16_streams(long_server, slow_phase_over)))
    )
    preemptions = long_server.metrics()["tokenloop_num_preemptions_total"]
    thread.start()  # rounds of 16 streams all through the slow read
    start = time.monotonic()
    while time.monotonic() - start < SLOW_FOR_S:
        received += sock.recv(SLOW_BYTES_PER_S)
        peak_rss = max(peak_rss, server_pid_rss_mb(long_server))
        paused_seen = max(paused_seen, long_server.metrics()["tokenloop_num_requests_paused"])
        time.sleep(1)
    slow_phase_over.set()
    thread.join(60)
    preempted = long_server.metrics()["tokenloop_num_preemptions_total"] - preemptions
    return sse_text(received + read_all(sock)), received, peak_rss, paused_seen, others["rounds"], preempted
