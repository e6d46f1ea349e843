"""`tokenloop bench pd`: colocated serving against prefill/decode disaggregation, on one mixed load.

A few streams decode all along (short prompts, one request after another), while long prompts (distinct, so no
prefix cache helps) arrive at a steady rate, then at a low one. Colocated, every long prompt is one long step for
every running stream; disaggregated, a prefill worker computes it on its own core while the decode worker goes
on. Reported per server, measured in the same run: under the steady load the running streams' inter-token
latency (p50, p99) and the output tokens per second over everything; under the low load the long prompts' time
to first token (no queue at the prefill worker: its one core against two); for the disaggregated server the
handoff (ms from the prefill's end to the decode worker holding the blocks, MB copied).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenloop.bench import record
from tokenloop.bench.common import DEFAULT_PROMPT, build_compiled_package, metric_values, serving
from tokenloop.bench.serve import RequestRecord, _stream_one, percentile

if TYPE_CHECKING:
    import httpx

GOALS = {"itl_p99": 5.0, "ttft_p50": 2.2, "throughput": 0.8}


@dataclass(frozen=True, slots=True)
class PDLoad:
    streams: int = 4  # requests decoding all along, each followed by the next
    stream_tokens: int = 128
    long_prompt_tokens: int = 1500
    long_every_s: float = 1.5  # the steady load: the streams' ITL and the throughput are measured under it
    long_count: int = 20
    low_every_s: float = 5.0  # the low load: the long prompts' TTFT is measured under it
    low_count: int = 5
    long_max_tokens: int = 16

    def __post_init__(self) -> None:
        for name in ("streams", "stream_tokens", "long_prompt_tokens", "long_count", "low_count", "long_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("long_every_s", "low_every_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclass(slots=True)
class Phase:
    """The records of one load: the streams' requests and the long prompts', over wall_s seconds."""

    streams: list[RequestRecord] = field(default_factory=list)
    long: list[RequestRecord] = field(default_factory=list)
    wall_s: float = 0.0

    def itl_ms(self, q: float) -> float:
        return 1e3 * percentile([gap for r in self.streams if r.ok for gap in r.itl_s], q)

    def ttft_ms(self, q: float) -> float:
        return 1e3 * percentile([r.ttft_s for r in self.long if r.ok], q)

    @property
    def tokens_per_s(self) -> float:
        return sum(r.output_tokens for r in self.streams + self.long if r.ok) / self.wall_s

    @property
    def failed(self) -> int:
        return sum(not r.ok for r in self.streams + self.long)


@dataclass(slots=True)
class Run:
    label: str
    steady: Phase = field(default_factory=Phase)
    low: Phase = field(default_factory=Phase)
    # The low load's means per long prompt: at the prefill worker (queue and compute), then handed over.
    prefill_ms: float = float("nan")
    handoff_ms: float = float("nan")
    handoff_mb: float = float("nan")
    blocks_skipped: float = 0.0


def long_prompts(model: str, load: PDLoad) -> list[list[int]]:
    """Distinct prompts of exactly load.long_prompt_tokens tokens, for both phases: a numbered header, then the
    default prompt's tokens over and over."""
    from tokenloop.models.loader import load_tokenizer

    tokenizer = load_tokenizer(model)
    filler = tokenizer.encode(" " + DEFAULT_PROMPT, add_special_tokens=False)
    prompts = []
    for k in range(load.long_count + load.low_count):
        ids = tokenizer.encode(f"Document {k} of the archive, copy {k * 7919}:", add_special_tokens=False)
        ids += filler * (load.long_prompt_tokens // len(filler) + 1)
        prompts.append(ids[: load.long_prompt_tokens])
    return prompts


async def run_phase(
    client: httpx.AsyncClient, url: str, model: str, prompts: list[list[int]], every_s: float, load: PDLoad
) -> Phase:
    """The streams decoding from the start; the prompts arriving every_s apart from a second later; until the
    last prompt is answered and each stream's request then running is done."""
    phase = Phase()
    stop = asyncio.Event()

    def body(prompt, max_tokens: int) -> dict:
        return {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    async def stream(slot: int) -> None:
        n = 0
        while not stop.is_set():
            phase.streams.append(r := RequestRecord())
            await _stream_one(client, url, body(f"Stream {slot}, part {n}. {DEFAULT_PROMPT}", load.stream_tokens), r)
            n += 1

    async def long(prompt: list[int], delay: float) -> None:
        await asyncio.sleep(delay)
        phase.long.append(r := RequestRecord())
        await _stream_one(client, url, body(prompt, load.long_max_tokens), r)

    start = time.perf_counter()
    streams = [asyncio.create_task(stream(i)) for i in range(load.streams)]
    await asyncio.sleep(1.0)  # the streams are decoding before the first long prompt arrives
    await asyncio.gather(*(long(p, k * every_s) for k, p in enumerate(prompts)))
    stop.set()
    await asyncio.gather(*streams)
    phase.wall_s = time.perf_counter() - start
    return phase


async def run_load(base_url: str, model: str, prompts: list[list[int]], load: PDLoad, label: str) -> Run:
    url = f"{base_url}/v1/completions"
    run = Run(label)
    import httpx

    limits = httpx.Limits(max_connections=load.streams + load.long_count + load.low_count + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await _stream_one(client, url, {"model": model, "prompt": "Warm up.", "max_tokens": 4}, RequestRecord())
        steady, low = prompts[: load.long_count], prompts[load.long_count :]
        run.steady = await run_phase(client, url, model, steady, load.long_every_s, load)
        before = metric_values((await client.get(f"{base_url}/metrics")).text)
        run.low = await run_phase(client, url, model, low, load.low_every_s, load)
        after = metric_values((await client.get(f"{base_url}/metrics")).text)

    def low_load(name: str) -> float:  # the low load's part of a counter
        return after.get(name, 0.0) - before.get(name, 0.0)

    if count := low_load("tokenloop_pd_handoff_seconds_count"):
        run.handoff_ms = 1e3 * low_load("tokenloop_pd_handoff_seconds_sum") / count
        run.handoff_mb = low_load("tokenloop_pd_handoff_megabytes_total") / count
        run.prefill_ms = (
            1e3 * low_load("tokenloop_pd_prefill_seconds_sum") / low_load("tokenloop_pd_prefill_seconds_count")
        )
        run.blocks_skipped = after["tokenloop_pd_blocks_skipped_total"]
    return run


def report(runs: list[Run], model: str, load: PDLoad) -> tuple[str, bool]:
    colocated, disaggregated = runs
    lines = [
        f"tokenloop bench pd: {model}, {load.streams} streams of {load.stream_tokens} tokens decoding all along; "
        f"steady load: {load.long_count} prompts of {load.long_prompt_tokens} tokens every {load.long_every_s:g} s; "
        f"low load: {load.low_count} every {load.low_every_s:g} s",
        f"{'':34}{'ITL p50 ms':>11}{'ITL p99 ms':>11}{'tokens/s':>10}{'TTFT p50 ms':>12}"
        f"{'low: TTFT p50':>14}{'p99 ms':>8}{'failed':>8}",
    ]
    for r in runs:
        lines.append(
            f"{r.label:34}{r.steady.itl_ms(50):>11.1f}{r.steady.itl_ms(99):>11.1f}{r.steady.tokens_per_s:>10.1f}"
            f"{r.steady.ttft_ms(50):>12.0f}{r.low.ttft_ms(50):>14.0f}{r.low.ttft_ms(99):>8.0f}"
            f"{r.steady.failed + r.low.failed:>8}"
        )
    ratios = {
        "itl_p99": colocated.steady.itl_ms(99) / disaggregated.steady.itl_ms(99),
        "ttft_p50": disaggregated.low.ttft_ms(50) / colocated.low.ttft_ms(50),
        "throughput": disaggregated.steady.tokens_per_s / colocated.steady.tokens_per_s,
    }
    met = {
        "itl_p99": ratios["itl_p99"] >= GOALS["itl_p99"],
        "ttft_p50": ratios["ttft_p50"] <= GOALS["ttft_p50"],
        "throughput": ratios["throughput"] >= GOALS["throughput"],
    }
    words = {
        "itl_p99": "running streams' ITL p99 (steady load), colocated / disaggregated",
        "ttft_p50": "long prompts' TTFT p50 (low load), disaggregated / colocated",
        "throughput": "output tokens/s (steady load), disaggregated / colocated",
    }
    for name, ratio in ratios.items():
        sign = "<=" if name == "ttft_p50" else ">="
        lines.append(f"{words[name]}: {ratio:.2f}x (goal {sign} {GOALS[name]}x: {'met' if met[name] else 'NOT met'})")
    low = [r.ttft_s for r in disaggregated.low.long if r.ok]
    rest = 1e3 * sum(low) / max(len(low), 1) - disaggregated.prefill_ms - disaggregated.handoff_ms
    lines.append(
        f"where a long prompt's TTFT goes at low load (means): prefill worker {disaggregated.prefill_ms:.0f} ms, "
        f"handoff {disaggregated.handoff_ms:.1f} ms ({disaggregated.handoff_mb:.2f} MB), the rest (the decode "
        f"worker's first step, the pipes) about {rest:.0f} ms; {disaggregated.blocks_skipped:.0f} blocks skipped"
    )
    failed = sum(r.steady.failed + r.low.failed for r in runs)
    return "\n".join(lines), all(met.values()) and not failed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="the model both servers serve (default: the default model)")
    parser.add_argument("--port", type=int, default=8012)
    defaults = PDLoad()
    parser.add_argument("--streams", type=int, default=defaults.streams, help="requests decoding all along")
    parser.add_argument("--long-prompt-tokens", type=int, default=defaults.long_prompt_tokens)
    parser.add_argument("--long-every", type=float, default=defaults.long_every_s, help="seconds between long prompts")
    parser.add_argument("--long-count", type=int, default=defaults.long_count)
    parser.add_argument(
        "--low-every", type=float, default=defaults.low_every_s, help="seconds between long prompts at low load"
    )
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    record.add_argument(parser)


def main_from_args(args: argparse.Namespace) -> int:
    """Both servers in turn (colocated at its defaults, then --disaggregate), the same load; exit 1 if a goal is
    missed."""
    from tokenloop.models.store import resolve

    model = str(resolve(args.model))
    load = PDLoad(
        args.streams,
        long_prompt_tokens=args.long_prompt_tokens,
        long_every_s=args.long_every,
        long_count=args.long_count,
    )
    if args.compile:
        build_compiled_package(model, "auto")
    prompts = long_prompts(model, load)
    base = [sys.executable, "-m", "tokenloop.cli", "serve", "--model", model, "--port", str(args.port)]
    base += ["--compile" if args.compile else "--no-compile"]
    url = f"http://127.0.0.1:{args.port}"
    runs = []
    for label, extra in (("colocated (all cores)", []), ("disaggregated (prefill | decode)", ["--disaggregate"])):
        with serving(base + extra, f"{url}/health"):
            runs.append(asyncio.run(run_load(url, model, prompts, load, label)))
    text, ok = report(runs, model, load)
    print(text)
    if args.record:
        record.save("pd", text)
    return 0 if ok else 1
