"""`tokenloop bench serve`: load any OpenAI-compatible server with concurrent streaming requests and report
throughput, time to first token (TTFT), inter-token latency (ITL) and end-to-end latency, as vLLM's
benchmark_serving does. Works against tokenloop's server, vLLM, llama.cpp and the like."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from tokenloop.bench.common import DEFAULT_PROMPT

ENDPOINTS = {"completions": "/completions", "chat": "/chat/completions"}


@dataclass(slots=True)
class ServeBenchConfig:
    base_url: str  # the server's OpenAI root, e.g. http://127.0.0.1:8000/v1
    model: str  # the model name the server expects in the request body
    num_requests: int = 32
    concurrency: int = 32  # requests in flight at once; all of them are ready at the start
    max_tokens: int = 128  # sent with ignore_eos, so that servers honouring it produce exactly this many
    prompt: str = DEFAULT_PROMPT
    endpoint: str = "completions"  # "completions" or "chat"
    api_key: str | None = None
    timeout_s: float = 600  # for the whole run: requests unfinished by then are recorded as failed

    def __post_init__(self) -> None:
        self.base_url = self.base_url.rstrip("/")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {self.base_url!r}")
        if not self.model:
            raise ValueError("model must be a non-empty string")
        for name in ("num_requests", "concurrency", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {sorted(ENDPOINTS)}, got {self.endpoint!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


@dataclass(slots=True)
class RequestRecord:
    ok: bool = False
    ttft_s: float | None = None  # request sent → first chunk with text
    itl_s: list[float] = field(default_factory=list)  # gaps between the later chunks with text
    e2e_s: float | None = None  # request sent → stream closed
    output_tokens: int = 0
    usage_reported: bool = False  # output_tokens is the server's usage.completion_tokens, not a chunk count
    status: int | None = None  # HTTP status; None when no response came
    error: str | None = None


@dataclass(slots=True)
class ServeBenchResult:
    config: ServeBenchConfig
    records: list[RequestRecord]
    wall_s: float  # first request sent → last request done

    @property
    def completed(self) -> list[RequestRecord]:
        return [r for r in self.records if r.ok]

    @property
    def num_failed(self) -> int:
        return len(self.records) - len(self.completed)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.completed)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def requests_per_s(self) -> float:
        return len(self.completed) / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def ttft_s(self) -> list[float]:
        return [r.ttft_s for r in self.completed]

    @property
    def itl_s(self) -> list[float]:
        return [gap for r in self.completed for gap in r.itl_s]

    @property
    def e2e_s(self) -> list[float]:
        return [r.e2e_s for r in self.completed]

    @property
    def errors(self) -> Counter[str]:
        return Counter(r.error for r in self.records if not r.ok)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100, linear interpolation); NaN when there are no values."""
    return float(np.percentile(values, q)) if values else float("nan")


def _request_body(config: ServeBenchConfig) -> dict:
    body = {
        "model": config.model,
        "max_tokens": config.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,  # vLLM's extension: every request runs to max_tokens; other servers ignore it
    }
    if config.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": config.prompt}]
    else:
        body["prompt"] = config.prompt
    return body


def _chunk_text(chunk: dict) -> str:
    choices = chunk.get("choices") or [{}]
    choice = choices[0]
    if "delta" in choice:  # chat: the first delta usually carries only the role
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


def _error_message(body: bytes) -> str:
    """The message of an OpenAI-style error body ({"error": {"message": ...}}), else the body's start."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.decode(errors="replace")[:200]
    error = data.get("error", data) if isinstance(data, dict) else data
    if isinstance(error, dict):
        error = error.get("message") or error.get("detail") or error
    return str(error)[:200]


async def _stream_one(client, url: str, body: dict, record: RequestRecord) -> None:
    """Send one streaming request, filling `record` as chunks arrive (so a timeout keeps what was seen)."""
    start = last = time.perf_counter()
    text_chunks = 0
    async with client.stream("POST", url, json=body) as response:
        record.status = response.status_code
        if response.status_code != 200:
            record.error = f"HTTP {response.status_code}: {_error_message(await response.aread())}"
            return
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, `event:` lines and `:` keep-alive comments
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                record.error = f"error in stream: {_error_message(data.encode())}"
                return
            if usage := chunk.get("usage"):
                record.output_tokens, record.usage_reported = usage["completion_tokens"], True
            if _chunk_text(chunk):
                now = time.perf_counter()
                if text_chunks == 0:
                    record.ttft_s = now - start
                else:
                    record.itl_s.append(now - last)
                last = now
                text_chunks += 1
    record.e2e_s = time.perf_counter() - start
    if text_chunks == 0:
        record.error = "no text in the response"
        return
    if not record.usage_reported:
        record.output_tokens = text_chunks  # one token per chunk, as servers stream them
    record.ok = True


async def run_serve_bench(config: ServeBenchConfig) -> ServeBenchResult:
    """Send config.num_requests streaming requests, at most config.concurrency at once, and time them."""
    import httpx

    url = config.base_url + ENDPOINTS[config.endpoint]
    body = _request_body(config)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    semaphore = asyncio.Semaphore(config.concurrency)
    records = [RequestRecord() for _ in range(config.num_requests)]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + config.timeout_s

    async def bounded(record: RequestRecord) -> None:
        async with semaphore:
            await _stream_one(client, url, body, record)

    async def guarded(record: RequestRecord) -> None:
        try:
            await asyncio.wait_for(bounded(record), max(deadline - loop.time(), 0))
        except asyncio.TimeoutError:
            record.error = f"unfinished after the {config.timeout_s:g} s time budget"
        except (httpx.HTTPError, ValueError, KeyError) as e:  # network failures, malformed JSON or chunks
            record.error = f"{type(e).__name__}: {e}"

    limits = httpx.Limits(max_connections=config.concurrency, max_keepalive_connections=config.concurrency)
    async with httpx.AsyncClient(headers=headers, timeout=config.timeout_s, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(guarded(r) for r in records))
        wall_s = time.perf_counter() - start
    return ServeBenchResult(config=config, records=records, wall_s=wall_s)


async def served_models(base_url: str, api_key: str | None = None, timeout_s: float = 30) -> list[str]:
    """The model ids listed at {base_url}/models."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(headers=headers, timeout=timeout_s) as client:
        response = await client.get(base_url.rstrip("/") + "/models")
        response.raise_for_status()
        return [m["id"] for m in response.json()["data"]]


def format_report(result: ServeBenchResult, label: str) -> str:
    config = result.config

    def ms(values: list[float], q: float) -> str:
        return f"{percentile(values, q) * 1000:.1f}"

    from_usage = result.completed and all(r.usage_reported for r in result.completed)
    counted = "server usage" if from_usage else "chunks counted"
    rows = [
        ("Requests completed / failed", f"{len(result.completed)} / {result.num_failed}"),
        ("Wall time (s)", f"{result.wall_s:.2f}"),
        (f"Output tokens ({counted})", f"{result.output_tokens}"),
        ("Output tokens/s", f"{result.output_tokens_per_s:.1f}"),
        ("Requests/s", f"{result.requests_per_s:.2f}"),
        ("TTFT p50 / p90 / p99 (ms)", " / ".join(ms(result.ttft_s, q) for q in (50, 90, 99))),
        ("ITL p50 / p99 (ms)", " / ".join(ms(result.itl_s, q) for q in (50, 99))),
        ("E2E p50 / p99 (s)", " / ".join(f"{percentile(result.e2e_s, q):.2f}" for q in (50, 99))),
    ]
    title = f" Serving benchmark: {label} "
    lines = [
        title.center(max(60, len(title) + 6), "="),
        f"{config.num_requests} requests, concurrency {config.concurrency}, max_tokens {config.max_tokens}, "
        f"{config.endpoint} endpoint",
    ]
    lines += [f"{name + ':':<40}{value:>20}" for name, value in rows]
    lines += [f"  {count} × {error}" for error, count in result.errors.most_common(5)]
    lines.append("=" * 60)
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's OpenAI root URL")
    parser.add_argument("--model", default=None, help="model name to request (default: the first at /models)")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight at once")
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per request (ignore_eos is sent)")
    parser.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="completions")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--timeout", type=float, default=600, help="time budget for the whole run, in seconds")


def run_from_args(args: argparse.Namespace) -> tuple[str, bool]:
    """Run the benchmark against the server at --base-url: its report, and whether every request succeeded."""
    import httpx

    model = args.model
    if model is None:
        try:
            model = asyncio.run(served_models(args.base_url, args.api_key))[0]
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
            raise ValueError(f"could not read the model name from {args.base_url}/models ({e}); pass --model") from e
    config = ServeBenchConfig(
        base_url=args.base_url,
        model=model,
        num_requests=args.num_requests,
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        endpoint=args.endpoint,
        api_key=args.api_key,
        timeout_s=args.timeout,
    )
    result = asyncio.run(run_serve_bench(config))
    return format_report(result, f"{model} @ {config.base_url}"), result.num_failed == 0
