"""Many continuations of one prefix, measured on the default model's fast path.

    python benchmarks/strategies.py [--items 48] [--n 8] [--questions 4]

Self-consistency: on the repo's arithmetic word problems (benchmarks/data/arithmetic_word_problems.jsonl,
written for it, answers known), the accuracy of one greedy answer, of one sample (temperature 0.8), and of
the vote of n samples (forked off one prefill; counting stops once the leader cannot be overtaken). An
answer is the number after "The answer is". Honest figures: the default model has 135M parameters.

Skeleton-of-thought: for a few open questions, the end-to-end latency of outline-then-expand with the
expansions forked off the outline and run together, against writing the same answer sequentially (the same
outline, then the same expansion prompts one after another).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tokenloop import LLM, SamplingParams
from tokenloop.strategies.self_consistency import AnswerSpec

DATA = Path(__file__).parent / "data" / "arithmetic_word_problems.jsonl"
ANSWER = r"[Tt]he answer is:?\s*\$?(-?[0-9][0-9,]*)"
ASK = "{question} Think step by step, then finish with: The answer is <number>."
QUESTIONS = [
    "How can I sleep better?",
    "What should I pack for a weekend hike?",
    "How do I start learning to cook?",
    "Why is exercise good for you?",
    "How can a small town reduce traffic?",
    "What makes a good team leader?",
]


def accuracy(llm: LLM, items: list[dict], n: int) -> None:
    spec = AnswerSpec(regex=ANSWER)
    conversations = [[{"role": "user", "content": ASK.format(question=item["question"])}] for item in items]
    prompts = [llm.chat_prompt(c) for c in conversations]

    def correct(answer: str | None, item: dict) -> bool:
        return answer is not None and answer.replace(",", "") == str(item["answer"])

    start = time.perf_counter()
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=256), use_tqdm=False)
    single = llm.generate(prompts, SamplingParams(temperature=0.8, seed=0, max_tokens=256), use_tqdm=False)
    plain_s = time.perf_counter() - start
    start = time.perf_counter()
    votes = [llm.self_consistency(p, n, spec, SamplingParams(temperature=0.8, seed=0, max_tokens=256)) for p in prompts]
    vote_s = time.perf_counter() - start
    greedy_ok = sum(correct(spec.read(o.outputs[0].text), item) for o, item in zip(greedy, items))
    single_ok = sum(correct(spec.read(o.outputs[0].text), item) for o, item in zip(single, items))
    voted_ok = sum(correct(v.answer, item) for v, item in zip(votes, items))
    answered = sum(v.answer is not None for v in votes)
    early = sum(v.stopped_early for v in votes)
    samples = sum(len(v.samples) for v in votes)
    k = len(items)
    print(f"self-consistency on {k} arithmetic word problems (default model, fast path)")
    print(f"  greedy, one answer             {greedy_ok:3d}/{k}  {greedy_ok / k:6.1%}")
    print(f"  one sample (temperature 0.8)   {single_ok:3d}/{k}  {single_ok / k:6.1%}")
    print(
        f"  vote of n={n} (temperature 0.8) {voted_ok:3d}/{k}  {voted_ok / k:6.1%}   ({answered} items with an answer; "
        f"{early} stopped early; {samples} of {n * k} samples finished)"
    )
    print(f"  time: greedy + one sample {plain_s:.1f} s, votes {vote_s:.1f} s")


def skeleton_latency(llm: LLM, questions: list[str]) -> None:
    params = SamplingParams(temperature=0, max_tokens=64)
    parallel_s = sequential_s = 0.0
    for question in questions:
        start = time.perf_counter()
        result = llm.skeleton_of_thought(question, params)
        parallel_s += time.perf_counter() - start
        # The same answer written sequentially: the same outline, then the same expansion prompts one after another.
        start = time.perf_counter()
        texts = llm.skeleton_of_thought(question, params, together=False).expansions
        sequential_s += time.perf_counter() - start
        same = texts == result.expansions
        print(f"  {question!r}: {len(result.points)} points, same text sequentially: {same}")
    k = len(questions)
    print(
        f"skeleton-of-thought on {k} questions: {parallel_s / k:.2f} s per answer with the points expanded together, "
        f"{sequential_s / k:.2f} s one after another ({sequential_s / parallel_s:.2f}x)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", type=int, default=48)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--questions", type=int, default=4)
    args = ap.parse_args()
    llm = LLM()
    items = [json.loads(line) for line in DATA.read_text().splitlines()][: args.items]
    accuracy(llm, items, args.n)
    skeleton_latency(llm, QUESTIONS[: args.questions])


if __name__ == "__main__":
    main()
