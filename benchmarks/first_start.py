"""A first start of `tokenloop generate` with no compiled package, against the eager start (`--no-compile`).

    python benchmarks/first_start.py [--max-tokens 64] [--prompt "..."]

Each run is a fresh process in a fresh $TOKENLOOP_HOME that holds the model and the C++ kernels (links to the
real ones) but no compiled package and no inductor cache. Times are from the process's start to the first byte
of generated text on its stdout. The default start must not wait for the compiler: it runs eager while a child
compiles in the background, so its time to first token should be the eager start's (goal: within +10%). The
script then waits for that child, reports its time and peak memory, and starts once more: that start loads the
package (its decode rate, from --stats, is the compiled one).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tokenloop.models.store import DEFAULT_MODEL, tokenloop_home


def fresh_home(root: Path) -> Path:
    home = Path(tempfile.mkdtemp(prefix="first-start-", dir=root))
    for shared in ("models", "kernels"):
        (home / shared).symlink_to(tokenloop_home() / shared)
    return home


def first_token(home: Path, prompt: str, max_tokens: int, *flags: str) -> tuple[float, str]:
    """(seconds from spawn to the first stdout byte, stderr) of one `tokenloop generate`."""
    env = os.environ | {"TOKENLOOP_HOME": str(home), "TORCHINDUCTOR_CACHE_DIR": str(home / "inductor")}
    start = time.perf_counter()
    proc = subprocess.Popen(
        ["tokenloop", "generate", prompt, "--max-tokens", str(max_tokens), "--stats", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    proc.stdout.read(1)
    ttft = time.perf_counter() - start
    proc.stdout.read()
    return ttft, proc.communicate()[1].decode()


def decode_rate(stderr: str) -> str:
    match = re.search(r"decode: \d+ tokens, ([\d.]+) tokens/s", stderr)
    return match.group(1) if match else "?"


def compile_worker_pids() -> list[int]:
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if b"tokenloop.engine.compile_worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.append(int(pid))
        except OSError:
            pass
    return pids


def wait_for_worker(timeout_s: float) -> tuple[float, float]:
    """(seconds until no compile worker is left, the workers' peak resident memory in MiB, from /proc)."""
    start, peak = time.perf_counter(), 0.0
    while (pids := compile_worker_pids()) and time.perf_counter() - start < timeout_s:
        for pid in pids:
            try:
                status = Path(f"/proc/{pid}/status").read_text()
                peak = max(peak, int(re.search(r"VmHWM:\s+(\d+)", status).group(1)) / 1024)
            except (OSError, AttributeError):
                pass
        time.sleep(0.5)
    return time.perf_counter() - start, peak


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt", default="The capital of France is")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--timeout", type=float, default=900, help="seconds to wait for the background compile")
    args = p.parse_args()
    if compile_worker_pids():
        print("a compile worker is running already: wait for it to end", file=sys.stderr)
        return 1
    subprocess.run(["tokenloop", "pull", DEFAULT_MODEL, "--no-compile"], check=True, stdout=subprocess.DEVNULL)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        eager = min(first_token(fresh_home(root), args.prompt, args.max_tokens, "--no-compile")[0] for _ in range(2))
        home = fresh_home(root)
        default, stderr = first_token(home, args.prompt, args.max_tokens)
        compile_s, peak_mib = wait_for_worker(args.timeout)
        built = sorted(p.name for p in (home / "compiled").glob("*.pt2"))
        second, second_err = first_token(home, args.prompt, args.max_tokens)
    print(f"tokenloop first start, {DEFAULT_MODEL}, {args.max_tokens} tokens ({time.strftime('%Y-%m-%d %H:%M')})")
    print(f"  eager start (--no-compile), time to first token:          {eager:6.2f} s")
    print(
        f"  default start, no package, time to first token:          {default:6.2f} s  "
        f"({default / eager:.2f}x eager; goal <= 1.10x)"
    )
    print(
        f"  background compile: {compile_s:.0f} s after that start ended, peak RSS {peak_mib:.0f} MiB, "
        f"built {built or 'nothing'}"
    )
    print(
        f"  next start, time to first token:                          {second:6.2f} s  "
        f"(decode {decode_rate(second_err)} tokens/s;"
        f" the first start's {decode_rate(stderr)})"
    )
    print("  the first start said on stderr:")
    for line in stderr.splitlines():
        if line.startswith("tokenloop:"):
            print(f"    {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
