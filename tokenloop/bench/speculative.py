"""`tokenloop bench --speculative`: speculative decoding against tokenloop's own compiled decode without it, in one run.

Rows, each a ratio of tokens per second with speculation to tokens per second without, same model, same
prompts, same compiled decode step, greedy:
- n-gram lookup on input-grounded chat (repeat, correct, rewrite, quote a given text), one request at a time;
- the default model's 4-bit fast path drafting for its exact float32 path, against plain float32 decode;
- n-gram lookup on open-ended chat, where it finds little (the cost model should turn drafting off);
- 32 concurrent requests with n-gram lookup, against the same 32 without;
- where the model has an EAGLE drafter (models/eagle.py: one ships for the default model): the head on open-ended
  chat, on 32 concurrent requests, and drafting for the float32 path beside the 4-bit self-draft, with its
  acceptance per position beside EAGLE-1's published figures.
Each repeat runs the two sides back to back, and a row's ratio is the median of the repeats' ratios: the
machine's speed moves by more than some rows' effect within minutes, and a pair run together shares the speed
of its moment (the best of each side alone paired one side's luckiest minute with the other's). The tokens per
second shown are the medians of each side. Every row also says whether the tokens were identical, the
acceptance rate, the mean accepted length and the mean draft length the cost model chose.
"""

from __future__ import annotations

import copy
import gc
import itertools
import statistics
import time
from dataclasses import dataclass, field

from tokenloop.bench.common import build_compiled_package
from tokenloop.bench.speculative_prompts import GROUNDED, OPEN
from tokenloop.outputs import SpeculativeUsage

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
DRAFT = {"method": "draft", "dtype": "auto", "num_speculative_tokens": 8}  # the target's own model, 4-bit
EAGLE = {"method": "eagle", "num_speculative_tokens": 4}  # and "model": the drafter's folder
# EAGLE-1's published acceptance per position on Vicuna-7B (its paper's n-alpha, MT-bench): the figures to set ours by
EAGLE_PUBLISHED = "about 0.79, 0.74, ... 0.67"


@dataclass(slots=True)
class Row:
    label: str
    goal: float  # the ratio it should reach
    plain_rates: list[float] = field(default_factory=list)  # tokens per second of each repeat
    spec_rates: list[float] = field(default_factory=list)
    identical: bool = False
    usage: SpeculativeUsage = field(default_factory=SpeculativeUsage)  # the timed runs' drafts and accepted tokens
    mean_draft_length: float = 0.0
    accepted_per_position: list[int] = field(default_factory=list)  # drafts whose token i was accepted (a chain)
    draft_ms_per_step: float = 0.0

    @property
    def chain_acceptance(self) -> list[float]:
        """Per position i: the share of drafts whose first i + 1 tokens were all accepted."""
        return [n / self.usage.num_drafts for n in self.accepted_per_position] if self.usage.num_drafts else []

    @property
    def conditional_acceptance(self) -> list[float]:
        """Per position i: the share of drafts reaching token i with it accepted, among those whose tokens before
        it were (EAGLE's "n-alpha"); only positions some draft reached."""
        reached = [self.usage.num_drafts, *self.accepted_per_position[:-1]]
        return [n / r for n, r in zip(self.accepted_per_position, reached) if r]

    @property
    def ratios(self) -> list[float]:
        """spec / plain of each repeat, the two run back to back."""
        return [spec / plain for spec, plain in zip(self.spec_rates, self.plain_rates)]

    @property
    def spread(self) -> str:
        """The lowest and highest paired ratio: how far the machine's speed moved the pairs."""
        return f"{min(self.ratios):.2f}-{max(self.ratios):.2f}"

    @property
    def plain_tps(self) -> float:
        return statistics.median(self.plain_rates)

    @property
    def spec_tps(self) -> float:
        return statistics.median(self.spec_rates)

    @property
    def ratio(self) -> float:
        """The median of the paired ratios."""
        return statistics.median(self.ratios)


def _run(llm, prompts: list[str], tokens: int, together: bool) -> tuple[float, list[list[int]]]:
    """Tokens per second over the prompts (chat-templated), one request at a time or all together."""
    from tokenloop import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens)
    conversations = [[{"role": "user", "content": p}] for p in prompts]
    start = time.perf_counter()
    if together:
        outs = llm.chat(conversations, params, use_tqdm=False)
    else:
        outs = [llm.chat(c, params, use_tqdm=False)[0] for c in conversations]
    seconds = time.perf_counter() - start
    ids = [o.outputs[0].token_ids for o in outs]
    return sum(map(len, ids)) / seconds, ids


def measure(row: Row, plain, spec, prompts: list[str], tokens: int, repeats: int, together: bool = False) -> Row:
    _run(plain, prompts, tokens, together)  # warm: the prompts enter both prefix caches, the cost model sees steps
    _run(spec, prompts, tokens, together)
    stats = spec.llm_engine.speculator.stats
    before = copy.deepcopy(stats)  # the timed runs' figures are the differences from here

    def timed(name: str) -> float:
        return getattr(stats, name) - getattr(before, name)

    plain_ids = spec_ids = None
    for _ in range(repeats):
        rate, plain_ids = _run(plain, prompts, tokens, together)
        row.plain_rates.append(rate)
        rate, spec_ids = _run(spec, prompts, tokens, together)
        row.spec_rates.append(rate)
    row.identical = plain_ids == spec_ids
    row.usage = SpeculativeUsage(timed("num_drafts"), timed("num_draft_tokens"), timed("num_accepted_tokens"))
    planned, steps = timed("num_planned_seqs"), timed("num_proposing_steps")
    row.mean_draft_length = timed("num_chosen_tokens") / planned if planned else 0.0
    row.accepted_per_position = [
        now - then
        for now, then in itertools.zip_longest(stats.accepted_per_position, before.accepted_per_position, fillvalue=0)
    ]
    row.draft_ms_per_step = 1e3 * timed("draft_seconds") / steps if steps else 0.0
    return row


def run(model: str, tokens: int = 128, repeats: int = 3, drafter: str | None = None) -> list[Row]:
    """`drafter`: an EAGLE drafter's folder for `model` (its rows are left out without one)."""
    from tokenloop import LLM

    build_compiled_package(model, "auto")
    build_compiled_package(model, "float32")
    rows = []
    plain = LLM(model, compile=True, compile_in_background=False)
    spec = LLM(model, compile=True, compile_in_background=False, speculative_config=NGRAM)
    rows.append(measure(Row("n-gram, input-grounded chat", 1.4), plain, spec, GROUNDED, tokens, repeats))
    rows.append(measure(Row("n-gram, open-ended chat", 0.97), plain, spec, OPEN, tokens, repeats))
    batch = [f"Request {i}. " + p for i, p in enumerate((GROUNDED + OPEN) * 4)][:32]
    rows.append(measure(Row("n-gram, 32 concurrent requests", 1.0), plain, spec, batch, tokens, repeats, together=True))
    if drafter is not None:
        del spec
        spec = LLM(model, compile=True, compile_in_background=False, speculative_config=EAGLE | {"model": drafter})
        rows.append(measure(Row("EAGLE head, open-ended chat", 1.5), plain, spec, OPEN, tokens, repeats))
        together = Row("EAGLE head, 32 concurrent requests", 1.0)
        rows.append(measure(together, plain, spec, batch, tokens, repeats, together=True))
        del spec  # the same head drafting 3 tokens every step: its acceptance per position, whatever it costs
        fixed = EAGLE | {"model": drafter, "num_speculative_tokens": 3, "adaptive": False}
        spec = LLM(model, compile=True, compile_in_background=False, speculative_config=fixed)
        rows.append(measure(Row("EAGLE head k=3, cost model off", 1.5), plain, spec, OPEN, tokens, repeats))
    del plain, spec
    gc.collect()
    float32 = {"dtype": "float32", "compile": True, "compile_in_background": False}
    plain = LLM(model, **float32)
    spec = LLM(model, **float32, speculative_config=DRAFT | {"model": model})
    prompts = OPEN[:2] + GROUNDED[:1]
    rows.insert(1, measure(Row("4-bit draft -> float32 target", 3.0), plain, spec, prompts, tokens, repeats))
    if drafter is not None:
        del spec
        spec = LLM(model, **float32, speculative_config=EAGLE | {"model": drafter})
        rows.insert(2, measure(Row("EAGLE head -> float32 target", 2.0), plain, spec, prompts, tokens, repeats))
    return rows


def format_rows(rows: list[Row], model: str, tokens: int, repeats: int) -> str:
    header = (
        f"{'':34}{'plain tok/s':>12}{'spec tok/s':>12}{'ratio':>8}{'spread':>13}{'goal':>7}"
        f"{'same tokens':>13}{'accepted':>10}{'mean len':>10}{'mean k':>8}"
    )
    lines = [
        f"tokenloop bench --speculative: {model}, greedy, up to {tokens} tokens per request, "
        f"median of {repeats} paired runs",
        header,
    ]
    for r in rows:
        verdict = "ok" if r.ratio >= r.goal else "SHORT"
        lines.append(
            f"{r.label:34}{r.plain_tps:>12.1f}{r.spec_tps:>12.1f}{r.ratio:>7.2f}x{r.spread:>13}"
            f"{'>=' + format(r.goal, '.2f'):>7}"
            f"{'yes' if r.identical else 'NO':>13}{r.usage.acceptance_rate:>10.2f}"
            f"{r.usage.mean_accepted_length or 1.0:>10.2f}{r.mean_draft_length:>8.2f}  {verdict}"
        )
    for r in rows:
        if r.label.startswith("EAGLE") and r.usage.num_drafts:
            chain = ", ".join(f"{a:.2f}" for a in r.chain_acceptance)
            conditional = ", ".join(f"{a:.2f}" for a in r.conditional_acceptance)
            lines.append(
                f"{r.label}: acceptance per position {conditional} (given the ones before; all of them: {chain}), "
                f"draft {r.draft_ms_per_step:.2f} ms/step; EAGLE-1 on Vicuna-7B: {EAGLE_PUBLISHED}"
            )
    lines.append(
        "plain = tokenloop's compiled decode without speculation (the float32 rows: plain float32); "
        "ratio = median of spec / plain over the paired runs (spread: lowest-highest)."
    )
    lines.append(
        "accepted = accepted / drafted tokens; mean len = tokens per verifying step; "
        "mean k = draft tokens the cost model chose per sequence-step."
    )
    return "\n".join(lines)


def report(model: str, tokens: int, repeats: int, drafter: str | None = None) -> str:
    return format_rows(run(model, tokens, repeats, drafter), model, tokens, repeats)
