"""Greedy tokens of tokenloop beside llama.cpp's on the same GGUF and the same prompt token ids.

    pip install -e ".[bench]"; python benchmarks/greedy_agreement_llamacpp.py [--dtype auto] [--tokens 32]

Reports, per prompt, how many leading tokens agree, and the share of prompts that agree in full. The engines
round differently (llama.cpp and the fast path both quantize activations to int8, each in its own order of
sums), so a near-tie between the two best tokens may flip and the texts diverge from there: the first
divergence is what counts.
"""

from __future__ import annotations

import argparse

from llama_cpp import Llama

from tokenloop import LLM, SamplingParams
from tokenloop.models.store import resolve

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
    "The quick brown fox",
    "In 1969, the first humans to walk on the moon were",
    "A good way to learn a new language is",
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    path = str(resolve(None))
    ours = LLM(path, dtype=args.dtype)
    theirs = Llama(path, n_ctx=512, n_threads=args.threads, verbose=False)
    eos = theirs.token_eos()

    def ban_eos(_ids, scores):  # as ignore_eos does here
        scores[eos] = -float("inf")
        return scores

    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    agreed_prefixes = []
    for prompt in PROMPTS:
        ids = ours.get_tokenizer().encode(prompt)
        mine = ours.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0].token_ids
        theirs.reset()
        peer = []
        for token in theirs.generate(ids, temp=0.0, top_k=1, logits_processor=[ban_eos]):
            peer.append(token)
            if len(peer) == args.tokens:
                break
        agree = next((i for i, (a, b) in enumerate(zip(mine, peer)) if a != b), min(len(mine), len(peer)))
        agreed_prefixes.append(agree)
        print(f"{agree:3d}/{args.tokens} tokens agree  {prompt!r}")
    full = sum(a == args.tokens for a in agreed_prefixes)
    mean = sum(agreed_prefixes) / len(agreed_prefixes)
    print(
        f"dtype {args.dtype}: {full}/{len(PROMPTS)} prompts agree on all {args.tokens} greedy tokens; "
        f"mean agreeing prefix {mean:.1f} tokens"
    )


if __name__ == "__main__":
    main()
