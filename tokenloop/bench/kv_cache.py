"""`tokenloop bench kv`: the int8 KV cache against the default 16-bit one, on one model, in one run.

What it measures, per KV cache dtype, each in a process of its own:
- perplexity on a fixed real text (Python's own documentation, pydoc_data.topics: it ships with every Python),
  in windows whose keys and values all come back through the cache;
- the tokens a pool of the same memory holds;
- single-stream decode after a long prompt (the step then reads as many bytes of cache as of weights) and after a
  short one: two engines in one process (compiled decode steps), taking turns for `rounds` rounds (first one, then
  the other), each figure the median (runs minutes apart in separate processes meet different spells of a shared
  machine);
- greedy tokens on the float32 parity prompts (bench/parity_prompts.py), on the fast path and in float32 mode:
  how many prompts give the 16-bit (or float32) cache's tokens exactly.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass

from tokenloop.bench import record
from tokenloop.bench.common import DEFAULT_PROMPT, build_compiled_package
from tokenloop.bench.offline import PROMPT_TOKENS, _prefill_prompt

KV_DTYPES = ("auto", "int8")
POOL_GB = 1.0  # the pool whose tokens are counted
PARITY_TOKENS = 32  # greedy tokens per parity prompt


@dataclass(slots=True)
class KVBenchConfig:
    model: str
    long_prompt_tokens: int = 4000
    decode_tokens: int = 128
    perplexity_tokens: int = 8192
    perplexity_window: int = 2048
    rounds: int = 5
    compile: bool = True


@dataclass(slots=True)
class Quality:
    perplexity: float
    scored_tokens: int
    pool_tokens: int
    cache_dtype: str  # the torch dtype "auto" or "int8" became
    parity_tokens: list[list[int]]  # greedy tokens per parity prompt, fast path
    float32_parity_tokens: list[list[int]]  # the same in float32 mode


@dataclass(slots=True)
class Speed:
    long_decode_tps: float  # after long_prompt_tokens, the median of the rounds
    short_decode_tps: float  # after the offline bench's decode prompt
    long_kv_mib: float  # the KV blocks the long request held at its end
    long_kv_every_layer_mib: float  # what it would hold with every layer keeping every block


def reference_text() -> str:
    import pydoc_data.topics

    return "\n\n".join(pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics))


def _quality(cfg: KVBenchConfig, kv: str) -> Quality:
    from tokenloop import LLM, SamplingParams
    from tokenloop.bench.parity_prompts import prompts
    from tokenloop.engine.perplexity import perplexity

    greedy = SamplingParams(temperature=0, max_tokens=PARITY_TOKENS, ignore_eos=True)

    def parity(llm: LLM) -> list[list[int]]:  # the prompts that fit the model's context
        fitting = [
            p for p in prompts(llm) if len(p["prompt_token_ids"]) + PARITY_TOKENS <= llm.llm_engine.max_model_len
        ]
        return [list(o.outputs[0].token_ids) for o in llm.generate(fitting, greedy, use_tqdm=False)]

    llm = LLM(cfg.model, kv_cache_dtype=kv, kv_cache_gb=POOL_GB, enable_prefix_caching=False, compile=False)
    engine = llm.llm_engine
    scored = perplexity(llm, reference_text(), window=cfg.perplexity_window, max_tokens=cfg.perplexity_tokens)
    fast = parity(llm)
    pool = engine.config.kv_cache_tokens(engine.model_config)
    dtype = str(engine.config.kv_dtype).removeprefix("torch.")
    del llm, engine
    exact = LLM(cfg.model, dtype="float32", kv_cache_dtype=kv, enable_prefix_caching=False, compile=False)
    return Quality(scored.perplexity, scored.num_scored_tokens, pool, dtype, fast, parity(exact))


def _speed(cfg: KVBenchConfig) -> dict[str, Speed]:
    from tokenloop import LLM, SamplingParams
    from tokenloop.engine.kv_groups import kv_bytes_per_block, kv_cache_groups
    from tokenloop.engine.streaming import StreamStats, stream

    engines = {
        kv: LLM(
            cfg.model, kv_cache_dtype=kv, enable_prefix_caching=False, compile=cfg.compile, compile_in_background=False
        ).llm_engine
        for kv in KV_DTYPES
    }
    tok = engines["auto"].tokenizer
    params = SamplingParams(temperature=0, max_tokens=cfg.decode_tokens, ignore_eos=True)

    held = {kv: 0 for kv in KV_DTYPES}  # the most blocks in use, read between steps
    computed = {kv: 0 for kv in KV_DTYPES}  # the most tokens with K/V in the cache, read alike

    def rate(kv: str, prompt_ids: list[int]) -> float:
        stats, engine = StreamStats(), engines[kv]
        for _ in stream(engine, {"prompt_token_ids": prompt_ids}, params, stats):
            held[kv] = max(held[kv], engine.block_manager.num_used_blocks)
            computed[kv] = max([computed[kv]] + [seq.num_computed_tokens for seq in engine.scheduler.running])
        return stats.decode_rate

    def mib(kv: str, blocks: int) -> float:
        engine = engines[kv]
        return (
            blocks * kv_bytes_per_block(engine.model_config, engine.config.block_size, engine.config.kv_dtype) / 2**20
        )

    long_ids = _prefill_prompt(tok.encode, cfg.long_prompt_tokens)
    short_ids = tok.encode(DEFAULT_PROMPT)[:PROMPT_TOKENS]  # the offline bench's decode prompt
    for kv in KV_DTYPES:  # warm-up: first-use costs (fresh buffers, the allocator) stay out of the timed runs
        rate(kv, long_ids[:512])
    runs = {kv: ([], []) for kv in KV_DTYPES}
    for i in range(cfg.rounds):
        for kv in KV_DTYPES if i % 2 == 0 else KV_DTYPES[::-1]:  # each goes first as often: no order effect
            held[kv] = computed[kv] = 0
            runs[kv][0].append(rate(kv, long_ids))
            runs[kv][1].append(rate(kv, short_ids))
    groups, block_size = len(kv_cache_groups(engines["auto"].model_config)), engines["auto"].config.block_size
    return {
        kv: Speed(
            statistics.median(long),
            statistics.median(short),
            mib(kv, held[kv]),
            mib(kv, -(-computed[kv] // block_size) * groups),
        )
        for kv, (long, short) in runs.items()
    }


def _run(task: str, cfg: KVBenchConfig, kv: str = "") -> dict:
    cmd = [sys.executable, "-m", "tokenloop.bench.kv_cache", task, kv, json.dumps(asdict(cfg))]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the {task} run failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(cfg: KVBenchConfig) -> tuple[dict[str, Quality], dict[str, Speed]]:
    if cfg.compile:
        for kv in KV_DTYPES:
            build_compiled_package(cfg.model, "auto", kv)
    quality = {kv: Quality(**_run("quality", cfg, kv)) for kv in KV_DTYPES}
    speed = {kv: Speed(**figures) for kv, figures in _run("speed", cfg).items()}
    return quality, speed


def format_report(cfg: KVBenchConfig, quality: dict[str, Quality], speed: dict[str, Speed]) -> str:
    base, int8 = quality["auto"], quality["int8"]
    base_speed, int8_speed = speed["auto"], speed["int8"]

    def agreeing(field: str) -> str:
        pairs = list(zip(getattr(base, field), getattr(int8, field)))
        return f"{sum(a == b for a, b in pairs)} of {len(pairs)}"

    rows = [
        (
            f"perplexity, {base.scored_tokens} tokens (windows of {cfg.perplexity_window})",
            f"{base.perplexity:.4f}",
            f"{int8.perplexity:.4f}",
            f"{(int8.perplexity / base.perplexity - 1) * 100:+.2f}%",
        ),
        (
            f"tokens in a {POOL_GB:g} GiB pool",
            str(base.pool_tokens),
            str(int8.pool_tokens),
            f"{int8.pool_tokens / base.pool_tokens:.2f}x",
        ),
        (
            f"decode after {cfg.long_prompt_tokens} prompt tokens, tokens/s",
            f"{base_speed.long_decode_tps:.1f}",
            f"{int8_speed.long_decode_tps:.1f}",
            f"{int8_speed.long_decode_tps / base_speed.long_decode_tps:.2f}x",
        ),
        (
            f"KV held by the {cfg.long_prompt_tokens}-token request, MiB",
            f"{base_speed.long_kv_mib:.1f}",
            f"{int8_speed.long_kv_mib:.1f}",
            f"{int8_speed.long_kv_mib / base_speed.long_kv_mib:.2f}x",
        ),
        (
            f"decode after a {PROMPT_TOKENS}-token prompt, tokens/s",
            f"{base_speed.short_decode_tps:.1f}",
            f"{int8_speed.short_decode_tps:.1f}",
            f"{int8_speed.short_decode_tps / base_speed.short_decode_tps:.2f}x",
        ),
    ]
    header = f"{'':52}{base.cache_dtype + ' cache':>16}{'int8 cache':>14}{'int8/' + base.cache_dtype:>16}"
    lines = [f"tokenloop bench kv: {cfg.model.rsplit('/', 1)[-1]}", header]
    lines += [f"{label:52}{a:>16}{b:>14}{ratio:>16}" for label, a, b, ratio in rows]
    lines.append(
        f"greedy tokens ({PARITY_TOKENS}) on the parity prompts equal to the {base.cache_dtype} cache's: "
        f"{agreeing('parity_tokens')}; in float32 mode, equal to the float32 cache's: "
        f"{agreeing('float32_parity_tokens')}"
    )
    lines.append(
        f"KV held: the most blocks in use between steps (every layer keeping every block: "
        f"{base_speed.long_kv_every_layer_mib:.1f} / {int8_speed.long_kv_every_layer_mib:.1f} MiB; sliding-window "
        "layers give back the blocks behind their window)."
    )
    lines.append(
        f"Decode figures: medians of {cfg.rounds} rounds, two engines in one process taking turns "
        f"({'compiled' if cfg.compile else 'eager'} decode steps); perplexity on pydoc_data.topics, Python's "
        "documentation."
    )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", "-m", default=None, help="known name or .gguf file (default: the default model)")
    parser.add_argument("--long-prompt-tokens", type=int, default=4000)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--perplexity-tokens", type=int, default=8192)
    parser.add_argument("--perplexity-window", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5, help="decode rounds; each figure is the median")
    record.add_argument(parser)


def main_from_args(args: argparse.Namespace) -> int:
    from tokenloop.models.store import resolve

    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    cfg = KVBenchConfig(
        str(resolve(args.model)),
        args.long_prompt_tokens,
        args.decode_tokens,
        args.perplexity_tokens,
        args.perplexity_window,
        args.rounds,
    )
    report = format_report(cfg, *measure(cfg))
    print(report)
    if args.record:
        record.save("kv", report)
    return 0


if __name__ == "__main__":
    task, kv, cfg_json = sys.argv[1:]
    cfg = KVBenchConfig(**json.loads(cfg_json))
    if task == "quality":
        print(json.dumps(asdict(_quality(cfg, kv))))
    else:
        print(json.dumps({dtype: asdict(speed) for dtype, speed in _speed(cfg).items()}))
