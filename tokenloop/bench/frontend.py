"""`tokenloop bench frontend`: what the work before a request is queued costs the requests already streaming.

A live server streams one long completion while /health is polled every 10 ms. Meanwhile, one after another, with
a quiet second between them: the first structured request since the server started, a 4 MB prompt (refused: its
bytes alone tell that it is far beyond the context), a 0.5 MB prompt (tokenized, then refused), a chat request
with a 40-field JSON schema the server has never seen, and a control: a window with no request in it.
Each disturbance lasts from its request's sending until its answer's headers: its input work (parsing, the chat
template, tokenizing, compiling the grammar, the checks), not its generation. For each: /health's p99 latency
while it lasts, and the stream's inter-token gaps that overlap it, their p99 against the quiet gaps' p99 (the
same stream before the first disturbance and after the last). The goals (/health p99 <= 50 ms, gap p99 within
1.5x of quiet) are checked on issue 31's three: the first, the 4 MB prompt and the schema; the 0.5 MB prompt, the
one that is tokenized, and the control are reported beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenloop.bench import record
from tokenloop.bench.common import DEFAULT_PROMPT, build_compiled_package, serving
from tokenloop.bench.serve import percentile

if TYPE_CHECKING:
    import httpx

QUIET_S = 3.0  # of stream before the first disturbance and after the last
PAUSE_S = 1.0  # between disturbances
HEALTH_EVERY_S = 0.01
CONTROL_S = 0.05  # a window as long as a disturbance, with nothing in it: how often the machine alone misses


@dataclass(slots=True)
class Disturbance:
    name: str
    goal: bool = True  # one of issue 31's three cases the goals hold for; else reported beside them
    start: float = 0.0
    end: float = 0.0
    status: int = 0


@dataclass(slots=True)
class Timeline:
    tokens: list[float] = field(default_factory=list)  # arrival of each streamed chunk
    health: list[tuple[float, float]] = field(default_factory=list)  # (sent, seconds until the answer)


def schema_of(num_fields: int, seed: int) -> dict:
    """A JSON schema of fresh field names (never compiled before by the server), strings, integers and booleans."""
    rng = random.Random(seed)
    names = [f"f{rng.getrandbits(48):012x}_{i}" for i in range(num_fields)]
    kinds = ["string", "integer", "boolean"]
    return {
        "type": "object",
        "properties": {name: {"type": kinds[i % 3]} for i, name in enumerate(names)},
        "required": names,
        "additionalProperties": False,
    }


def structured_body(num_fields: int, seed: int, model: str) -> dict:
    schema = schema_of(num_fields, seed)
    return {
        "model": model,
        "messages": [{"role": "user", "content": "Fill in the record."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "record", "schema": schema}},
        "max_tokens": 8,
        "stream": True,
    }


async def _stream(client: httpx.AsyncClient, model: str, timeline: Timeline, stop: asyncio.Event) -> None:
    body = {"model": model, "prompt": DEFAULT_PROMPT, "max_tokens": 6000, "ignore_eos": True, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                timeline.tokens.append(time.perf_counter())
            if stop.is_set():
                return


async def _poll_health(client: httpx.AsyncClient, timeline: Timeline, stop: asyncio.Event) -> None:
    while not stop.is_set():
        sent = time.perf_counter()
        await client.get("/health")
        timeline.health.append((sent, time.perf_counter() - sent))
        await asyncio.sleep(HEALTH_EVERY_S)


async def _disturb(client: httpx.AsyncClient, d: Disturbance, method: str | None, body: dict | None) -> None:
    """Send the request (its JSON encoded beforehand: the client's work is not the server's); the disturbance ends
    with the answer's headers (a stream is then closed unread). No method: a control window, no request at all."""
    if method is None:
        d.start = time.perf_counter()
        await asyncio.sleep(CONTROL_S)
        d.end = time.perf_counter()
        return
    content, headers = json.dumps(body).encode(), {"content-type": "application/json"}
    d.start = time.perf_counter()
    async with client.stream("POST", method, content=content, headers=headers) as response:
        d.end, d.status = time.perf_counter(), response.status_code


async def run(base_url: str, model: str, prompt_mb: float, num_fields: int) -> tuple[Timeline, list[Disturbance]]:
    timeline, stop = Timeline(), asyncio.Event()

    def prompt(mb: float) -> dict:
        return {"model": model, "prompt": "All work and no play makes Jack a dull boy. " * int(mb * 2**20 / 44)}

    plan = [
        (Disturbance("first structured request since start"), "/v1/chat/completions", structured_body(3, 0, model)),
        (Disturbance(f"{prompt_mb:g} MB prompt, refused"), "/v1/completions", prompt(prompt_mb)),
        (Disturbance("0.5 MB prompt, tokenized and refused (*)", goal=False), "/v1/completions", prompt(0.5)),
        (
            Disturbance(f"{num_fields}-field JSON schema, never seen"),
            "/v1/chat/completions",
            structured_body(num_fields, 1, model),
        ),
        (Disturbance(f"control: {CONTROL_S * 1e3:.0f} ms, no request (*)", goal=False), None, None),
    ]
    import httpx

    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        tasks = [asyncio.create_task(_stream(client, model, timeline, stop))]
        while not timeline.tokens:
            await asyncio.sleep(0.01)
        tasks.append(asyncio.create_task(_poll_health(client, timeline, stop)))
        await asyncio.sleep(QUIET_S)
        for d, method, body in plan:
            await _disturb(client, d, method, body)
            await asyncio.sleep(PAUSE_S)
        await asyncio.sleep(QUIET_S - PAUSE_S)
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    return timeline, [d for d, _, _ in plan]


def report(timeline: Timeline, disturbances: list[Disturbance]) -> tuple[str, bool]:
    gaps = [(a, b, b - a) for a, b in zip(timeline.tokens, timeline.tokens[1:])]
    first, last = disturbances[0].start, disturbances[-1].end
    quiet = [g for a, b, g in gaps if b < first or a > last + PAUSE_S]
    quiet_p99 = percentile(quiet, 99)
    lines = [
        f"quiet: {len(quiet)} inter-token gaps, p50 {percentile(quiet, 50) * 1e3:.1f} ms, p99 {quiet_p99 * 1e3:.1f} ms",
        f"{'while':<42} {'status':>6} {'lasted':>9} {'/health p99':>12} {'gaps':>5} {'gap p99':>9} {'/ quiet':>8}",
    ]
    ok = True
    for d in disturbances:
        during = [g for a, b, g in gaps if b >= d.start and a <= d.end]
        health = [s for t, s in timeline.health if d.start <= t + s and t <= d.end]
        gap_p99, health_p99 = percentile(during, 99), percentile(health, 99)
        ratio = gap_p99 / quiet_p99
        # a window shorter than the polls may hold none: nan, which no goal fails on
        ok = ok and (not d.goal or (not health_p99 > 0.05 and ratio <= 1.5))
        lines.append(
            f"{d.name:<42} {d.status:>6} {(d.end - d.start) * 1e3:>7.0f} ms {health_p99 * 1e3:>9.1f} ms "
            f"{len(during):>5} {gap_p99 * 1e3:>6.1f} ms {ratio:>7.2f}x"
        )
    lines.append(f"goals (*: not counted): /health p99 <= 50 ms, gap p99 <= 1.5x quiet: {'met' if ok else 'NOT met'}")
    return "\n".join(lines), ok


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="the model tokenloop serves (default: the default model)")
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--prompt-mb", type=float, default=4.0, help="the refused prompt's size")
    parser.add_argument("--fields", type=int, default=40, help="the never-seen schema's fields")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--threads", type=int, default=None, help="the server's CPU threads (default: its own choice)")
    record.add_argument(parser)


def main_from_args(args: argparse.Namespace) -> int:
    """Start a server, run the stream and the disturbances against it, print the report; exit 1 if a goal is missed."""
    from tokenloop.models.store import resolve

    model = str(resolve(args.model))
    if args.compile:
        build_compiled_package(model, "auto")
    cmd = [sys.executable, "-m", "tokenloop.cli", "serve", "--model", model, "--port", str(args.port)]
    cmd += ["--threads", str(args.threads)] if args.threads is not None else []
    with serving([*cmd, "--compile" if args.compile else "--no-compile"], f"http://127.0.0.1:{args.port}/health"):
        timeline, disturbances = asyncio.run(run(f"http://127.0.0.1:{args.port}", model, args.prompt_mb, args.fields))
    text, ok = report(timeline, disturbances)
    print(text)
    if args.record:
        record.save("frontend", text)
    return 0 if ok else 1
