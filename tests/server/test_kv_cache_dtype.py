"""`tokenloop serve --kv-cache-dtype int8`: the pool holds the int8 cache's block count, and a completion's tokens
are the offline engine's over the same int8 cache; an unknown dtype is refused at start-up."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import build_llm, model_config
from tests.server.conftest import MODEL_NAME, start_server, stop_server
from tokenloop import SamplingParams
from tokenloop.engine.config import EngineConfig

PROMPT = "Hello world! Hello tokenizers, hello templates. " * 3


def test_an_int8_server_holds_its_blocks_and_gives_the_offline_int8_tokens(tiny_model_folder, tmp_path):
    server = start_server(
        tiny_model_folder, tmp_path / "server.log", "--kv-cache-gb", "0.01", "--kv-cache-dtype", "int8"
    )
    try:
        out = server.client().completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0)
        blocks = server.metrics()["tokenloop_kv_cache_blocks_total"]
    finally:
        stop_server(server)
    config = EngineConfig(dtype="float32", device="cpu", kv_cache_gb=0.01, kv_cache_dtype="int8")
    sixteen_bit = EngineConfig(dtype="float32", device="cpu", kv_cache_gb=0.01)
    model = model_config(tiny_model_folder)
    assert blocks == config.num_kv_blocks(model) > sixteen_bit.num_kv_blocks(model)
    offline = build_llm(tiny_model_folder, dtype="float32", kv_cache_dtype="int8")
    expected = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    assert out.choices[0].text == expected[0].outputs[0].text


def test_an_unknown_kv_cache_dtype_is_refused_at_start_up(tiny_model_folder):
    proc = subprocess.run(
        [sys.executable, "-m", "tokenloop.cli", "serve", "--model", str(tiny_model_folder), "--kv-cache-dtype", "fp8"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--kv-cache-dtype: invalid choice: 'fp8'" in proc.stderr
