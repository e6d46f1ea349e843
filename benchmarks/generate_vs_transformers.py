"""Decode speed of `tokenloop generate --stats` next to transformers' `generate` on the same GGUF, in one run.

    python benchmarks/generate_vs_transformers.py [--tokens 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time

import torch

from tokenloop.models.store import resolve

PROMPT = "The history of the printing press begins"


def tokenloop_rates(tokens: int, dtype: str) -> tuple[float, float]:
    cmd = [sys.executable, "-m", "tokenloop.cli", "generate", PROMPT, "--max-tokens", str(tokens), "--dtype", dtype, "--stats"]
    err = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    prefill, decode = map(float, re.findall(r"([\d.]+) tokens/s", err))
    return prefill, decode


def transformers_rate(tokens: int) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve(None)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)  # warm-up, and the prefill cost
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        first = time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **kwargs)
        total = time.perf_counter() - start
    generated = out.shape[1] - ids.shape[1]
    return (generated - 1) / (total - first)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    _, ours = tokenloop_rates(args.tokens, "float32")
    theirs = transformers_rate(args.tokens)
    print(f"decode tokens/s, {args.tokens} greedy tokens, float32, {args.threads} threads")
    print(f"  tokenloop generate --stats : {ours:8.1f}")
    print(f"  transformers generate      : {theirs:8.1f}")
    print(f"  ratio tokenloop/transformers: {ours / theirs:.2f}x")


if __name__ == "__main__":
    main()
