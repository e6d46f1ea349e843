"""The serving benchmark client against a tiny OpenAI-style streaming server that sends known chunks at known
times (a test double for the client, on its own event loop in a thread as a real server would be). Where a test
checks the client's figures, the clock the client reads is a virtual one that only the server's delays move: every
figure is exact, however busy the machine."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

pytest.importorskip("httpx")

from tokenloop.bench import serve as serve_module  # noqa: E402
from tokenloop.bench.common import DEFAULT_PROMPT  # noqa: E402
from tokenloop.bench.serve import (  # noqa: E402
    RequestRecord,
    ServeBenchConfig,
    ServeBenchResult,
    format_report,
    percentile,
    run_serve_bench,
)
from tokenloop.bench.serve_peers import add_arguments, main_from_args  # noqa: E402


class VirtualClock:
    """time.perf_counter for tokenloop.bench.serve, moved only by the fake server's delays. The server sends a text
    chunk only once the client has read the clock for the one before (lockstep, for one request at a time), so each
    reading the client takes is exactly the time the server says."""

    def __init__(self) -> None:
        self.now, self.readings = 1000.0, 0

    def perf_counter(self) -> float:
        self.readings += 1
        return self.now

    async def until_read(self, seen: int) -> None:
        deadline = time.monotonic() + 60  # a guard against a client that never reads: no figure depends on it
        while self.readings <= seen:
            assert time.monotonic() < deadline, "the client never timed the chunk"
            await asyncio.sleep(0.001)


@dataclass(slots=True)
class FakeBehaviour:
    text_chunks: int = 5
    first_delay_s: float = 0.0  # request received → first text chunk
    gap_s: float = 0.0  # between text chunks
    tokens_per_chunk: int = 2  # so that usage (chunks × 2) differs from a chunk count
    send_usage: bool = True  # a usage chunk when stream_options.include_usage asks for one
    status: int = 200  # anything else answers an OpenAI error body
    bodies: list[dict] = field(default_factory=list)  # the JSON bodies received
    headers: list[dict[str, str]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    text_chunks_sent: int = 0
    clock: VirtualClock | None = None  # None: real delays (asyncio.sleep)


def _event(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return _chunked(f"data: {data}\n\n".encode())


def _chunked(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


async def _stream(writer: asyncio.StreamWriter, b: FakeBehaviour, body: dict) -> None:
    chat = "messages" in body
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
    if chat:  # as OpenAI does: a first delta with the role only, which is not the first token
        writer.write(_event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}))
    writer.write(_chunked(b": keep-alive\n\n"))
    await writer.drain()
    seen = 0
    for i in range(b.text_chunks):
        delay = b.first_delay_s if i == 0 else b.gap_s
        if b.clock is None:
            await asyncio.sleep(delay)
        else:
            if i:
                await b.clock.until_read(seen)  # the client has timed the chunk before this one
            b.clock.now += delay
            seen = b.clock.readings
        choice = {"index": 0, "delta": {"content": f"t{i} "}} if chat else {"index": 0, "text": f"t{i} "}
        writer.write(_event({"choices": [choice]}))
        await writer.drain()
        b.text_chunks_sent += 1
    if b.send_usage and body.get("stream_options", {}).get("include_usage"):
        usage = {"prompt_tokens": 7, "completion_tokens": b.text_chunks * b.tokens_per_chunk}
        writer.write(_event({"choices": [], "usage": usage}))
    writer.write(_event("[DONE]") + b"0\r\n\r\n")


def _json_response(status: int, payload: dict) -> bytes:
    data = json.dumps(payload)
    return (
        f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
        f"Connection: close\r\n\r\n{data}"
    ).encode()


async def _handle(b: FakeBehaviour, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    b.in_flight += 1
    b.max_in_flight = max(b.max_in_flight, b.in_flight)
    try:
        head = (await reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
        headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in head[1:] if line)}
        raw = await reader.readexactly(int(headers.get("content-length", 0)))
        if head[0].startswith("GET /v1/models"):
            writer.write(_json_response(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}))
            return
        body = json.loads(raw)
        b.bodies.append(body)
        b.headers.append(headers)
        if b.status != 200:
            writer.write(_json_response(b.status, {"error": {"message": "max_tokens is too large"}}))
            return
        await _stream(writer, b, body)
    except ConnectionError:
        pass  # the client gave up (the time budget test)
    finally:
        b.in_flight -= 1
        writer.close()


@contextmanager
def fake_openai_server(behaviour: FakeBehaviour) -> Iterator[str]:
    """Serve `behaviour` on a free port of 127.0.0.1; yields the base URL (…/v1)."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    servers: list[asyncio.Server] = []

    async def start() -> None:
        servers.append(await asyncio.start_server(lambda r, w: _handle(behaviour, r, w), "127.0.0.1", 0))
        ready.set()

    async def stop() -> None:
        servers[0].close()
        for task in asyncio.all_tasks() - {asyncio.current_task()}:
            task.cancel()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(start()), loop.run_forever()))
    thread.start()
    ready.wait(5)
    try:
        yield f"http://127.0.0.1:{servers[0].sockets[0].getsockname()[1]}/v1"
    finally:
        asyncio.run_coroutine_threadsafe(stop(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def _bench(base_url: str, **kwargs) -> ServeBenchResult:
    return asyncio.run(run_serve_bench(ServeBenchConfig(base_url=base_url, model="m", **kwargs)))


def test_completions_timings_and_usage_tokens(monkeypatch):
    """The first text chunk 0.2 s after the request (a keep-alive before it), four more 0.05 s apart, on the virtual
    clock: the time to the first text chunk, the four gaps and the whole stream are exactly those, request by
    request; the token count is the server's usage, not the chunks'."""
    clock = VirtualClock()
    monkeypatch.setattr(serve_module, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    fake = FakeBehaviour(text_chunks=5, first_delay_s=0.2, gap_s=0.05, clock=clock)
    with fake_openai_server(fake) as url:
        result = _bench(url, num_requests=4, concurrency=1, max_tokens=10)
    assert result.num_failed == 0 and len(result.completed) == 4
    for r in result.records:
        assert r.ttft_s == pytest.approx(0.2) and r.itl_s == pytest.approx([0.05] * 4)
        assert r.e2e_s == pytest.approx(r.ttft_s + sum(r.itl_s)) == pytest.approx(0.4)
        assert r.status == 200 and r.usage_reported and r.output_tokens == 10  # usage, not the 5 chunks
    assert result.wall_s == pytest.approx(4 * 0.4)  # one request at a time
    assert result.output_tokens == 40
    assert result.output_tokens_per_s == pytest.approx(40 / result.wall_s)
    assert result.requests_per_s == pytest.approx(4 / result.wall_s)
    body = fake.bodies[0]
    assert body["prompt"] == DEFAULT_PROMPT and body["model"] == "m" and body["max_tokens"] == 10
    assert body["stream"] is True and body["ignore_eos"] is True and body["temperature"] == 0
    assert body["stream_options"] == {"include_usage": True}


def test_chat_ignores_role_only_delta_and_counts_chunks_without_usage():
    fake = FakeBehaviour(text_chunks=3, first_delay_s=0.15, gap_s=0.01, send_usage=False)
    with fake_openai_server(fake) as url:
        result = _bench(url, num_requests=2, endpoint="chat")
    assert result.num_failed == 0
    for r in result.records:
        assert r.ttft_s >= 0.15  # the role-only delta came at once; it is not the first token
        assert r.output_tokens == 3 and not r.usage_reported
    assert fake.bodies[0]["messages"] == [{"role": "user", "content": DEFAULT_PROMPT}]
    assert "Output tokens (chunks counted)" in format_report(result, "fake")


def test_concurrency_is_bounded_by_the_semaphore():
    fake = FakeBehaviour(text_chunks=3, first_delay_s=0.05, gap_s=0.02)
    with fake_openai_server(fake) as url:
        result = _bench(url, num_requests=6, concurrency=2)
    assert result.num_failed == 0
    assert fake.max_in_flight == 2
    assert result.wall_s >= 3 * 0.09  # three waves of two


def test_http_error_is_recorded_per_request():
    fake = FakeBehaviour(status=400)
    with fake_openai_server(fake) as url:
        result = _bench(url, num_requests=3)
    assert len(result.completed) == 0 and result.num_failed == 3
    for r in result.records:
        assert not r.ok and r.status == 400
        assert r.error == "HTTP 400: max_tokens is too large"
    report = format_report(result, "fake")
    assert "0 / 3" in report and "3 × HTTP 400: max_tokens is too large" in report
    assert "nan" in report  # no latencies to summarise


def test_unreachable_server_is_recorded_not_raised():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free once closed: nothing listens there
    result = _bench(f"http://127.0.0.1:{port}/v1", num_requests=2)
    assert result.num_failed == 2
    assert all(r.status is None and r.error.startswith("ConnectError") for r in result.records)


def test_time_budget_bounds_the_run():
    """A server a minute from its first chunk, a budget of 0.3 s: the run ends at its budget, not at the server's
    pace: before the server sent anything."""
    fake = FakeBehaviour(first_delay_s=60.0)
    with fake_openai_server(fake) as url:
        result = _bench(url, num_requests=3, concurrency=1, timeout_s=0.3)
        assert fake.text_chunks_sent == 0
    assert result.num_failed == 3
    assert all("time budget" in r.error for r in result.records)


def test_percentiles_and_summary_from_known_records():
    records = [
        RequestRecord(ok=True, ttft_s=t, itl_s=[0.01, 0.03], e2e_s=1.0 + t, output_tokens=8)
        for t in (0.1, 0.2, 0.3, 0.4)
    ]
    records.append(RequestRecord(error="HTTP 500: boom", status=500))
    result = ServeBenchResult(config=ServeBenchConfig("http://x/v1", "m"), records=records, wall_s=2.0)
    assert percentile(result.ttft_s, 50) == pytest.approx(0.25)
    assert percentile(result.ttft_s, 90) == pytest.approx(0.37)
    assert percentile(result.itl_s, 50) == pytest.approx(0.02)
    assert math.isnan(percentile([], 50))
    assert result.output_tokens == 32 and result.output_tokens_per_s == 16.0 and result.requests_per_s == 2.0
    report = format_report(result, "known")
    assert "known" in report and "4 / 1" in report and "16.0" in report
    assert "250.0 / 370.0 / 397.0" in report  # TTFT p50 / p90 / p99 in ms
    assert "1 × HTTP 500: boom" in report


@pytest.mark.parametrize(
    "kwargs", [{"concurrency": 0}, {"num_requests": -1}, {"endpoint": "embeddings"}, {"timeout_s": 0}]
)
def test_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        ServeBenchConfig(base_url="http://x/v1", model="m", **kwargs)
    with pytest.raises(ValueError, match="base_url"):
        ServeBenchConfig(base_url="localhost:8000", model="m")


def test_main_from_args_finds_the_model_and_prints_the_report(capsys):
    fake = FakeBehaviour(text_chunks=2)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with fake_openai_server(fake) as url:
        args = parser.parse_args(["--base-url", url, "--num-requests", "2", "--api-key", "secret"])
        assert main_from_args(args) == 0
    assert all(body["model"] == "fake-model" for body in fake.bodies)
    assert fake.headers[0]["authorization"] == "Bearer secret"
    out = capsys.readouterr().out
    assert "fake-model @ " in out and "2 / 0" in out
