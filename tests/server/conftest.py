"""Real `tokenloop serve` processes on the tiny model, talked to over HTTP with the `openai` client and httpx.

Two servers serve most tests: a plain one (with a small KV pool, so that concurrent requests must wait and get
preempted) and one that requires an API key; the hardening tests start their own, configured for what they try.
Each is stopped with SIGTERM and must exit with status 0 in time.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

MODEL_NAME = "tiny-llama"
API_KEY = "test-key-123"
# KV blocks of the tiny model: 2 layers x (K, V) x 2 KV heads x 16 dims x 16 tokens x 4 bytes = 8 KiB each.
# 0.0003 GiB holds 39 blocks (624 tokens): more than one full-context request, far less than 32 concurrent ones.
KV_CACHE_GB = 0.0003
STARTUP_TIMEOUT_S = 60
SHUTDOWN_TIMEOUT_S = 40  # the server's own drain: 30 s, then 2 s for the last chunks


@dataclass
class Server:
    port: int
    process: subprocess.Popen
    log: Path
    api_key: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, api_key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=api_key or self.api_key or "unused", max_retries=0, timeout=60
        )

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key=self.api_key or "unused", max_retries=0, timeout=60
        )

    def http(self) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60)

    def metrics(self) -> dict[str, float]:
        """Every sample of GET /metrics by name (histograms as name_count / name_sum / name_bucket of +Inf)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.endswith("_bucket") and s.labels.get("le") != "+Inf":
                    continue
                samples[s.name] = s.value
        return samples


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    model_folder: Path, log: Path, *extra: str, api_key: str | None = None, startup_timeout: float = STARTUP_TIMEOUT_S
) -> Server:
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "tokenloop.cli",
        "serve",
        "--model",
        str(model_folder),
        "--served-model-name",
        MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--device",
        "cpu",
        *extra,
    ]
    if api_key:
        cmd += ["--api-key", api_key]
    with log.open("wb") as out:
        process = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=os.environ | {"PYTHONUNBUFFERED": "1"}
        )
    server = Server(port, process, log, api_key)
    deadline = time.monotonic() + startup_timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the server exited with {process.returncode} while starting:\n{log.read_text()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=1).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    stop_server(server)
    pytest.fail(f"no 200 from /health within {startup_timeout} s:\n{log.read_text()}")


def stop_server(server: Server) -> None:
    server.process.send_signal(signal.SIGTERM)
    try:
        code = server.process.wait(timeout=SHUTDOWN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()
        pytest.fail(f"the server did not exit within {SHUTDOWN_TIMEOUT_S} s of SIGTERM:\n{server.log.read_text()}")
    # The server drains on SIGTERM and exits with status 0 (not 143, "killed by SIGTERM").
    log = server.log.read_text()
    assert code == 0 and "Finished server process" in log, f"exit status {code} on SIGTERM:\n{log}"
    assert "Traceback" not in log, f"the server logged an exception:\n{log}"


@pytest.fixture(scope="session")
def server(tiny_model_folder, tmp_path_factory):
    s = start_server(
        tiny_model_folder, tmp_path_factory.mktemp("server") / "server.log", "--kv-cache-gb", str(KV_CACHE_GB)
    )
    yield s
    stop_server(s)


@pytest.fixture(scope="session")
def keyed_server(tiny_model_folder, tmp_path_factory):
    s = start_server(
        tiny_model_folder,
        tmp_path_factory.mktemp("keyed_server") / "server.log",
        "--kv-cache-gb",
        "0.01",
        api_key=API_KEY,
    )
    yield s
    stop_server(s)


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="session")
def hf_tokenizer(tiny_model_folder):
    """The tiny tokenizer as transformers reads it: the reference for prompt token counts."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(tiny_model_folder)


def server_pid_rss_mb(server: Server) -> float:
    """The server process's resident memory, from /proc."""
    for line in Path(f"/proc/{server.process.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/PID/status")


@pytest.fixture(scope="session")
def real_server(default_model_path, tmp_path_factory):
    """The default model (SmolLM2-135M-Instruct, fast path) behind the server: for what a random model cannot
    show (a model that writes a tool call, or JSON it was asked for, on its own)."""
    s = start_server(
        default_model_path,
        tmp_path_factory.mktemp("real_server") / "server.log",
        "--dtype",
        "auto",
        "--kv-cache-gb",
        "0.25",
    )
    yield s
    stop_server(s)


@pytest.fixture(scope="session")
def real_client(real_server) -> openai.OpenAI:
    return real_server.client()
