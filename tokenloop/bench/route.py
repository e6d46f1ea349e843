"""`tokenloop bench route`: the replica routers on a multi-tenant load, in one run.

Tenants share long system prompts; together they outgrow one replica's KV cache (each replica holds about half of
them). A router blind to the cache sends every tenant everywhere, and each replica's cache churns; the prefix router
sends a tenant where its blocks are. Per router, one server after another (`tokenloop serve --replicas N --router
R`, the same engines, the same requests in the same order): time to first token, the prefix-cache hit rate the
replicas measured, the hit rate the router predicted, and output tokens per second.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import dataclass, field

from tokenloop.bench import record
from tokenloop.bench.common import DEFAULT_PROMPT, build_compiled_package, metric_values, serving
from tokenloop.bench.serve import RequestRecord, _stream_one, percentile

GOALS = {"ttft_p50": 1.5, "hit_rate": 1.8, "prediction_points": 5.0}
ROUTERS = ("prefix", "round-robin")


@dataclass(frozen=True, slots=True)
class RouteLoad:
    tenants: int = 12
    system_tokens: int = 800
    requests: int = 96
    concurrency: int = 4
    max_tokens: int = 8
    replicas: int = 2
    seed: int = 0


@dataclass(slots=True)
class RouterRun:
    router: str
    records: list[RequestRecord] = field(default_factory=list)
    wall_s: float = 0.0
    prompt_tokens: float = 0.0
    actual_hits: float = 0.0
    predicted_hits: float = 0.0

    def ttft_ms(self, q: float) -> float:
        return 1e3 * percentile([r.ttft_s for r in self.records if r.ok], q)

    @property
    def hit_rate(self) -> float:
        return self.actual_hits / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def predicted_rate(self) -> float:
        return self.predicted_hits / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def tokens_per_s(self) -> float:
        return sum(r.output_tokens for r in self.records if r.ok) / self.wall_s

    @property
    def failed(self) -> int:
        return sum(not r.ok for r in self.records)


def requests(model: str, load: RouteLoad) -> list[list[int]]:
    """The requests' prompts (token ids): a tenant's system prompt, then a question of its own; tenants in a random
    order (seeded), the same for every router."""
    from tokenloop.models.loader import load_tokenizer

    tokenizer = load_tokenizer(model)
    filler = tokenizer.encode(" " + DEFAULT_PROMPT, add_special_tokens=False)
    systems = []
    for t in range(load.tenants):
        ids = tokenizer.encode(f"You are the assistant of tenant {t}, account {t * 7919}.", add_special_tokens=False)
        systems.append((ids + filler * (load.system_tokens // len(filler) + 1))[: load.system_tokens])
    rng = random.Random(load.seed)
    return [
        systems[rng.randrange(load.tenants)] + tokenizer.encode(f" Question {i}: what next?", add_special_tokens=False)
        for i in range(load.requests)
    ]


def kv_cache_gb(model: str, load: RouteLoad) -> float:
    """Each replica's KV cache: half the tenants' system prompts, and room for its running requests."""
    from tokenloop.engine.config import EngineConfig
    from tokenloop.engine.kv_groups import kv_bytes_per_block
    from tokenloop.models.loader import load_config

    config = EngineConfig(model=model)
    blocks = (load.tenants // 2) * (load.system_tokens // config.block_size) + load.concurrency * 4
    return blocks * kv_bytes_per_block(load_config(model), config.block_size, config.kv_dtype) / 2**30


async def run_load(base_url: str, model: str, prompts: list[list[int]], load: RouteLoad, router: str) -> RouterRun:
    run = RouterRun(router, [RequestRecord() for _ in prompts])
    semaphore = asyncio.Semaphore(load.concurrency)
    body = {"model": model, "max_tokens": load.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    body["stream_options"] = {"include_usage": True}

    async def one(prompt: list[int], r: RequestRecord) -> None:
        async with semaphore:
            await _stream_one(client, f"{base_url}/v1/completions", body | {"prompt": prompt}, r)

    import httpx

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=load.concurrency + 2)) as client:
        start = time.perf_counter()
        await asyncio.gather(*(one(p, r) for p, r in zip(prompts, run.records)))
        run.wall_s = time.perf_counter() - start
        metrics = (await client.get(f"{base_url}/metrics")).text
    samples = metric_values(metrics)
    run.prompt_tokens = samples.get("tokenloop_router_prompt_tokens_total", 0.0)
    run.actual_hits = samples.get("tokenloop_router_actual_hit_tokens_total", 0.0)
    run.predicted_hits = samples.get("tokenloop_router_predicted_hit_tokens_total", 0.0)
    return run


def report(runs: list[RouterRun], model: str, load: RouteLoad, cache_gb: float) -> tuple[str, bool]:
    prefix, blind = runs
    lines = [
        f"tokenloop bench route: {model}, {load.replicas} replicas with {cache_gb * 1024:.0f} MiB of KV cache each, "
        f"{load.tenants} tenants x {load.system_tokens}-token system prompts, {load.requests} requests, "
        f"{load.concurrency} at a time",
        f"{'router':14}{'TTFT p50 ms':>12}{'TTFT p99 ms':>12}{'hit rate':>10}{'predicted':>11}{'tokens/s':>10}"
        f"{'failed':>8}",
    ]
    for r in runs:
        lines.append(
            f"{r.router:14}{r.ttft_ms(50):>12.0f}{r.ttft_ms(99):>12.0f}{r.hit_rate:>10.2f}{r.predicted_rate:>11.2f}"
            f"{r.tokens_per_s:>10.1f}{r.failed:>8}"
        )
    ttft = blind.ttft_ms(50) / prefix.ttft_ms(50)
    hits = prefix.hit_rate / blind.hit_rate if blind.hit_rate else float("inf")
    points = 100 * abs(prefix.predicted_rate - prefix.hit_rate)
    met = [ttft >= GOALS["ttft_p50"], hits >= GOALS["hit_rate"], points <= GOALS["prediction_points"]]
    lines += [
        f"TTFT p50, round-robin / prefix: {ttft:.2f}x (goal >= {GOALS['ttft_p50']}x: {'met' if met[0] else 'NOT met'})",
        f"hit rate, prefix / round-robin: {hits:.2f}x (goal >= {GOALS['hit_rate']}x: {'met' if met[1] else 'NOT met'})",
        f"prefix router's predicted hit rate off the actual by {points:.1f} points (goal <= "
        f"{GOALS['prediction_points']:g}: {'met' if met[2] else 'NOT met'})",
    ]
    return "\n".join(lines), all(met) and not any(r.failed for r in runs)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="the model the replicas serve (default: the default model)")
    parser.add_argument("--port", type=int, default=8013)
    defaults = RouteLoad()
    parser.add_argument("--tenants", type=int, default=defaults.tenants)
    parser.add_argument("--requests", type=int, default=defaults.requests)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    record.add_argument(parser)


def main_from_args(args: argparse.Namespace) -> int:
    """The routers in turn, each its own server on a fresh local Ray instance; exit 1 if a goal is missed."""
    from tokenloop.models.store import resolve

    model = str(resolve(args.model))
    load = RouteLoad(tenants=args.tenants, requests=args.requests)
    if args.compile:
        build_compiled_package(model, "auto")
    prompts, cache_gb = requests(model, load), kv_cache_gb(model, load)
    url = f"http://127.0.0.1:{args.port}"
    runs = []
    for router in ROUTERS:
        cmd = [sys.executable, "-m", "tokenloop.cli", "serve", "--model", model, "--port", str(args.port)]
        cmd += ["--replicas", str(load.replicas), "--router", router, "--kv-cache-gb", f"{cache_gb:.6f}"]
        cmd += ["--compile" if args.compile else "--no-compile"]
        with serving(cmd, f"{url}/health"):
            runs.append(asyncio.run(run_load(url, model, prompts, load, router)))
    text, ok = report(runs, model, load, cache_gb)
    print(text)
    if args.record:
        record.save("route", text)
    return 0 if ok else 1
