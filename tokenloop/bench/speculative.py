"""`tokenloop bench --speculative`: speculative decoding against tokenloop's own compiled decode without it, in one run.

Four rows, each a ratio of tokens per second with speculation to tokens per second without, same model, same
prompts, same compiled decode step, greedy:
- n-gram lookup on input-grounded chat (repeat, correct, rewrite, quote a given text), one request at a time;
- the default model's 4-bit fast path drafting for its exact float32 path, against plain float32 decode;
- n-gram lookup on open-ended chat, where it finds little (the cost model should turn drafting off);
- 32 concurrent requests with n-gram lookup, against the same 32 without.
Each repeat runs the two sides back to back, and a row's ratio is the median of the repeats' ratios: the
machine's speed moves by more than some rows' effect within minutes, and a pair run together shares the speed
of its moment (the best of each side alone paired one side's luckiest minute with the other's). The tokens per
second shown are the medians of each side. Every row also says whether the tokens were identical, the
acceptance rate, the mean accepted length and the mean draft length the cost model chose.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, field

from tokenloop.bench.common import build_compiled_package
from tokenloop.bench.speculative_prompts import GROUNDED, OPEN
from tokenloop.outputs import SpeculativeUsage

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
DRAFT = {"method": "draft", "dtype": "auto", "num_speculative_tokens": 8}  # the target's own model, 4-bit


@dataclass(slots=True)
class Row:
    label: str
    goal: float  # the ratio it should reach
    plain_rates: list[float] = field(default_factory=list)  # tokens per second of each repeat
    spec_rates: list[float] = field(default_factory=list)
    identical: bool = False
    usage: SpeculativeUsage = field(default_factory=SpeculativeUsage)  # the timed runs' drafts and accepted tokens
    mean_draft_length: float = 0.0

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
    before = (
        stats.num_drafts,
        stats.num_draft_tokens,
        stats.num_accepted_tokens,
        stats.num_planned_steps,
        stats.num_chosen_tokens,
    )
    plain_ids = spec_ids = None
    for _ in range(repeats):
        rate, plain_ids = _run(plain, prompts, tokens, together)
        row.plain_rates.append(rate)
        rate, spec_ids = _run(spec, prompts, tokens, together)
        row.spec_rates.append(rate)
    drafts, draft_tokens, accepted, planned, chosen = (
        now - then
        for now, then in zip(
            (
                stats.num_drafts,
                stats.num_draft_tokens,
                stats.num_accepted_tokens,
                stats.num_planned_steps,
                stats.num_chosen_tokens,
            ),
            before,
        )
    )
    row.identical = plain_ids == spec_ids
    row.usage = SpeculativeUsage(drafts, draft_tokens, accepted)
    row.mean_draft_length = chosen / planned if planned else 0.0
    return row


def run(model: str, tokens: int = 128, repeats: int = 3) -> list[Row]:
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
    del plain, spec
    gc.collect()
    plain = LLM(model, dtype="float32", compile=True, compile_in_background=False)
    spec = LLM(
        model, dtype="float32", compile=True, compile_in_background=False, speculative_config=DRAFT | {"model": model}
    )
    rows.insert(
        1, measure(Row("4-bit draft -> float32 target", 3.0), plain, spec, OPEN[:2] + GROUNDED[:1], tokens, repeats)
    )
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
    lines.append(
        "plain = tokenloop's compiled decode without speculation (the float32 row: plain float32); "
        "ratio = median of spec / plain over the paired runs (spread: lowest-highest)."
    )
    lines.append(
        "accepted = accepted / drafted tokens; mean len = tokens per verifying step; "
        "mean k = draft tokens the cost model chose per sequence-step."
    )
    return "\n".join(lines)


def report(model: str, tokens: int, repeats: int) -> str:
    return format_rows(run(model, tokens, repeats), model, tokens, repeats)
