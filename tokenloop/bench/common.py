"""What the benches share: the prompt they send, the compiled package built before anything is timed, and the
wait for a server they started."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

# 91 prompt tokens with SmolLM2's tokenizer; fixed so that runs and servers compare like for like.
DEFAULT_PROMPT = (
    "The old lighthouse keeper climbed the spiral stairs every evening, counting each of the one hundred and "
    "twelve steps as his father had taught him. At the top he trimmed the wick, polished the great lens and "
    "watched the grey sea turn to silver under the rising moon. Ships rarely passed anymore, yet he kept the "
    "light burning through every storm. One winter night, a small boat appeared on the horizon, drifting "
    "without sails toward the rocks. He grabbed his lantern and"
)


def build_compiled_package(model: str, dtype: str, kv_cache_dtype: str = "auto") -> None:
    """Start tokenloop once with `compile`, in a process of its own, waiting for the compiler, so that the
    decode package is in the cache before a measured run: every later start loads it, and that is what the
    tables measure (the package serves any thread count)."""
    script = (
        f"from tokenloop import LLM; LLM({model!r}, dtype={dtype!r}, kv_cache_dtype={kv_cache_dtype!r}, "
        "compile=True, compile_in_background=False)"
    )
    subprocess.run([sys.executable, "-c", script], check=True)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 900) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} while starting")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"no 200 from {url} within {timeout:g} s")


@contextmanager
def serving(cmd: list[str], health_url: str) -> Iterator[subprocess.Popen]:
    """A server process started from `cmd`, healthy, for the block; stopped as a supervisor would (SIGTERM)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(health_url, proc)
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def metric_values(text: str) -> dict[str, float]:
    """A Prometheus text page as sample name -> value (a name with several label sets: its last one)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
