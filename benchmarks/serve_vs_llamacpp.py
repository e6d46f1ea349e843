"""`tokenloop bench serve` against tokenloop's server and llama-cpp-python's server on the same GGUF, one after
the other in one run (never both at once: they would share the CPU), with each server's peak RSS.

    pip install -e ".[bench]" && python benchmarks/serve_vs_llamacpp.py [--num-requests 32 --concurrency 32 --max-tokens 128] [--no-compile]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx

from tokenloop.bench.offline import build_compiled_package
from tokenloop.bench.serve import ServeBenchConfig, format_report, run_serve_bench
from tokenloop.models.store import resolve


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(url)


def peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def bench(label: str, cmd: list[str], port: int, health: str, model: str, args) -> str:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(f"http://127.0.0.1:{port}{health}", proc)
        config = ServeBenchConfig(
            base_url=f"http://127.0.0.1:{port}/v1", model=model, num_requests=args.num_requests,
            concurrency=args.concurrency, max_tokens=args.max_tokens, endpoint="completions",
        )
        report = format_report(asyncio.run(run_serve_bench(config)), label)
        return f"{report}\n  peak RSS: {peak_rss_mib(proc.pid):.0f} MiB\n"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True, help="tokenloop's compiled decode step")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    path = str(resolve(None))
    if args.compile:
        build_compiled_package(path, args.dtype)  # the server then starts from the cache, as every start after the first
    ours = [sys.executable, "-m", "tokenloop.cli", "serve", "--model", path, "--port", "8000", "--dtype", args.dtype,
            "--compile" if args.compile else "--no-compile"]
    print(bench(f"tokenloop ({args.dtype}{', compiled' if args.compile else ''})", ours, 8000, "/health", path, args))
    peer = [sys.executable, "-m", "llama_cpp.server", "--model", path, "--host", "127.0.0.1", "--port", "8081",
            "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads), "--interrupt_requests", "False",
            "--n_ctx", "4096"]
    print(bench(f"llama-cpp-python server ({args.threads} threads)", peer, 8081, "/v1/models", path, args))


if __name__ == "__main__":
    main()
