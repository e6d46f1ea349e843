"""Time to first token of a ~1,500-token prompt, then of a second prompt sharing that prefix (prefix cache hit).

python benchmarks/prefix_cache_ttft.py [--dtype float32]
"""

from __future__ import annotations

import argparse
import time

from tokenloop import LLM, SamplingParams

PREFIX = " ".join(
    f"Clause {i}: the tenant keeps the garden, pays on the {i % 28 + 1}th and feeds the cat." for i in range(75)
)


def ttft(llm: LLM, prompt: str) -> tuple[float, int, int]:
    start = time.perf_counter()
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    return time.perf_counter() - start, len(out.prompt_token_ids), out.num_cached_tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    llm = LLM(dtype=args.dtype)
    llm.generate("warm up", SamplingParams(max_tokens=2), use_tqdm=False)
    first, n1, c1 = ttft(llm, PREFIX + " Question one: who feeds the cat?")
    second, n2, c2 = ttft(llm, PREFIX + " Question two: when is the rent due?")
    print(f"first request : {n1} prompt tokens, {c1} cached, time to first token {first * 1e3:.0f} ms")
    print(f"second request: {n2} prompt tokens, {c2} cached, time to first token {second * 1e3:.0f} ms")
    print(f"ratio second/first: {second / first:.3f}")


if __name__ == "__main__":
    main()
