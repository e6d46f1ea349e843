"""`tokenloop bench serve --peer llama-server[,llama-cpp-python]`: tokenloop's server and its peers on the same
GGUF, one after the other (never at once: they would share the CPU), the same prompts and load, each server's
peak RSS, and tokenloop's ratios against each.

llama-server runs with as many parallel slots (`-np`) as the concurrency, continuous batching on; the
llama-cpp-python server is a reference row (its binding, one request at a time).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
import time
from dataclasses import dataclass

from tokenloop.bench import record, serve
from tokenloop.bench.common import build_compiled_package, serving
from tokenloop.bench.serve import ServeBenchConfig, ServeBenchResult, format_report, percentile, run_serve_bench

PEERS = ("llama-server", "llama-cpp-python")
CONTEXT_PER_SLOT = 512  # llama-server splits -c among its slots: 91 prompt + 128 output tokens fit


@dataclass(slots=True)
class ServerRun:
    label: str
    result: ServeBenchResult
    peak_rss_mib: float


def _peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _run(label: str, cmd: list[str], port: int, health: str, bench: ServeBenchConfig) -> ServerRun:
    with serving(cmd, f"http://127.0.0.1:{port}{health}") as proc:
        result = asyncio.run(run_serve_bench(dataclasses.replace(bench, base_url=f"http://127.0.0.1:{port}/v1")))
        return ServerRun(label, result, _peak_rss_mib(proc.pid))


def compare(
    model: str, peers: list[str], bench: ServeBenchConfig, threads: int, compile: bool, llama_cpp_bin: str | None
) -> str:
    """Serve `model` with tokenloop, then with each peer, under the same load; the reports and the ratios."""
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        raise ValueError(f"--peer must be among {', '.join(PEERS)}, got {', '.join(unknown)}")
    if compile:
        build_compiled_package(model, "auto")  # the server then starts from the cache, as every start after the first
    ours = [
        sys.executable,
        "-m",
        "tokenloop.cli",
        "serve",
        "--model",
        model,
        "--port",
        "8000",
        "--threads",
        str(threads),
        "--compile" if compile else "--no-compile",
        "--max-waiting",
        str(max(256, bench.num_requests)),
    ]
    runs = [
        _run(f"tokenloop serve ({'compiled' if compile else 'eager'}, {threads} threads)", ours, 8000, "/health", bench)
    ]
    for peer in peers:
        if peer == "llama-server":
            from tokenloop.bench.peers import llama_cpp_bin as find_bin

            slots = bench.concurrency
            cmd = [
                str(find_bin(llama_cpp_bin) / "llama-server"),
                "-m",
                model,
                "--host",
                "127.0.0.1",
                "--port",
                "8081",
                "-np",
                str(slots),
                "-c",
                str(slots * CONTEXT_PER_SLOT),
                "-t",
                str(threads),
                "-tb",
                str(threads),
                "-cb",
            ]
            label = f"llama-server -np {slots} -c {slots * CONTEXT_PER_SLOT} -t {threads} (llama.cpp C++)"
            runs.append(_run(label, cmd, 8081, "/health", bench))
        else:
            cmd = [
                sys.executable,
                "-m",
                "llama_cpp.server",
                "--model",
                model,
                "--host",
                "127.0.0.1",
                "--port",
                "8082",
                "--n_threads",
                str(threads),
                "--n_threads_batch",
                str(threads),
                "--interrupt_requests",
                "False",
                "--n_ctx",
                "4096",
            ]
            runs.append(
                _run(
                    f"llama-cpp-python server, {threads} threads (the binding: a reference row)",
                    cmd,
                    8082,
                    "/v1/models",
                    bench,
                )
            )
    lines = [f"{format_report(r.result, r.label)}\n  peak RSS: {r.peak_rss_mib:.0f} MiB" for r in runs]
    ours_run = runs[0]
    for peer in runs[1:]:
        throughput = (
            ours_run.result.output_tokens_per_s / peer.result.output_tokens_per_s
            if peer.result.output_tokens_per_s
            else float("nan")
        )
        lines.append(
            f"tokenloop / {peer.label.split(' (')[0]}: output tokens/s {throughput:.2f}x, "
            f"TTFT p99 {percentile(ours_run.result.ttft_s, 99):.2f} s vs {percentile(peer.result.ttft_s, 99):.2f} s, "
            f"peak RSS {ours_run.peak_rss_mib / peer.peak_rss_mib:.2f}x"
        )
    lines.append(f"measured {time.strftime('%Y-%m-%d %H:%M')} on {os.cpu_count()} CPUs, one server at a time")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    serve.add_arguments(parser)
    peers = parser.add_argument_group(
        "peers: start tokenloop's server and each peer in turn on the same GGUF (--base-url is then unused)"
    )
    peers.add_argument(
        "--peer",
        default=None,
        help="comma-separated: llama-server (llama.cpp's C++, -np = concurrency), llama-cpp-python",
    )
    peers.add_argument("--gguf", default=None, help="the model file the servers load (default: the default model)")
    peers.add_argument("--threads", type=int, default=os.cpu_count(), help="CPU threads of every server")
    peers.add_argument(
        "--compile", action=argparse.BooleanOptionalAction, default=True, help="tokenloop's compiled decode step"
    )
    peers.add_argument(
        "--llama-cpp-bin",
        default=None,
        help="a folder with llama-server (default: built once into $TOKENLOOP_HOME/peers)",
    )
    record.add_argument(parser)


def main_from_args(args: argparse.Namespace) -> int:
    """Run the benchmark (against --base-url, or tokenloop and its --peer servers) and print its report; exit
    status 1 when any request failed."""
    if args.peer:
        from tokenloop.models.store import resolve

        gguf = str(resolve(args.gguf))
        bench = ServeBenchConfig(
            base_url="http://127.0.0.1:8000/v1",
            model=args.model or gguf,
            num_requests=args.num_requests,
            concurrency=args.concurrency,
            max_tokens=args.max_tokens,
            endpoint=args.endpoint,
            timeout_s=args.timeout,
        )
        report, ok = compare(gguf, args.peer.split(","), bench, args.threads, args.compile, args.llama_cpp_bin), True
    else:
        report, ok = serve.run_from_args(args)
    print(report)
    if args.record:
        record.save("serve", report)
    return 0 if ok else 1
