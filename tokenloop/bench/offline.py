"""`tokenloop bench`: tokenloop beside llama.cpp and transformers on the same GGUF, same prompts, same threads.

Each engine runs in a subprocess of its own (so that peak RSS is its own); the table prints tokenloop/peer
ratios from this one run. llama.cpp (`pip install -e .[bench]`) and transformers are used when installed.
Every timed figure is the best of `repeats` runs, for every engine alike: on a shared machine a run is
only ever slowed down by others, and one slow run of one engine would otherwise decide a ratio (`--median`: their
median instead, which one lucky run cannot lift either). The runs go
in rounds, every engine once a round in turn, so that the engines meet the same spells of a busy machine: run
engine by engine, a spell that fell on one engine's runs decided the ratio (two runs of the same build, minutes
apart on 2 shared cores, measured Gemma 3's decode ratio at 1.33x and 1.02x).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch

from tokenloop.bench import record
from tokenloop.bench.common import DEFAULT_PROMPT, build_compiled_package
from tokenloop.models.huge_pages import advise_huge_pages

# llama-bench: llama.cpp's own C++ (the peer ratios are claimed against); llama-cpp-python: its Python binding,
# about 16% slower, a reference row.
ENGINES = ("tokenloop", "llama-bench", "llama-cpp-python", "transformers")
PROMPT_TOKENS = 64  # the decode and batch prompts: the first tokens of DEFAULT_PROMPT
SAMPLED = {"temperature": 0.8, "top_p": 0.95}  # the sampled batch's settings, set against greedy's


@dataclass(slots=True)
class BenchConfig:
    model: str  # a local .gguf path (llama.cpp and transformers need the file)
    dtype: str = "auto"  # tokenloop's dtype
    compile: bool = True  # tokenloop's compiled decode step
    threads: int | None = 2  # None: tokenloop's own choice (one per idle core)
    decode_tokens: int = 128
    prefill_tokens: int = 1024
    batch_sizes: tuple[int, ...] = (8, 32)
    repeats: int = 3  # each timed figure: the best (or the median) of this many runs
    statistic: str = "best"  # or "median": how an engine's runs make its figure
    llama_cpp_bin: str | None = None  # a folder with llama-bench; None = build it into $TOKENLOOP_HOME/peers
    decode_only: bool = False  # only the single-stream decode figure (the busy-core row)


@dataclass(slots=True)
class EngineResult:
    engine: str
    decode_tps: float | None = None  # single stream, tokens/s after the first token
    prefill_tps: float | None = None  # prompt of prefill_tokens, tokens/s
    ttft_ms: float | None = None  # time to first token of that prompt
    batch_tps: dict[str, float] | None = None  # concurrent requests → output tokens/s
    peak_rss_mib: float | None = None
    weight_bytes: int | None = None  # bytes a decode step reads at least
    busy_decode_tps: float | None = None  # single stream while another process keeps one core busy
    sampled_batch_tps: float | None = None  # the largest batch, sampling at SAMPLED settings (seeded per request)
    note: str | None = None  # what ran, printed under the table (a peer's build)
    error: str | None = None


def _prefill_prompt(tokenize, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenize(DEFAULT_PROMPT)
    return ids[:n]


def _bench_tokenloop(cfg: BenchConfig) -> EngineResult:
    from tokenloop import LLM, SamplingParams
    from tokenloop.engine.streaming import StreamStats, stream

    llm = LLM(cfg.model, dtype=cfg.dtype, enable_prefix_caching=False, compile=cfg.compile)
    engine, tok = llm.llm_engine, llm.get_tokenizer()
    greedy = SamplingParams(temperature=0, max_tokens=cfg.decode_tokens, ignore_eos=True)
    # Warmed up as llama-bench is (its warm-up run is a prompt of the timed size and one decode step): the timed
    # figures then pay no first-use costs (page faults in fresh activation buffers, the allocator's growth).
    llm.generate(
        {"prompt_token_ids": _prefill_prompt(tok.encode, cfg.prefill_tokens)},
        SamplingParams(max_tokens=4),
        use_tqdm=False,
    )

    def timed(prompt_ids: list[int], params: SamplingParams) -> StreamStats:
        stats = StreamStats()
        for _ in stream(engine, {"prompt_token_ids": prompt_ids}, params, stats):
            pass
        return stats

    def batch_rate(size: int, sampled: bool = False) -> float:
        prompts = [{"prompt_token_ids": tok.encode(f"Story {i}: ") + prompt} for i in range(size)]
        params = [SamplingParams(**SAMPLED, seed=i, max_tokens=cfg.decode_tokens, ignore_eos=True) for i in range(size)]
        start = time.perf_counter()
        outs = llm.generate(prompts, params if sampled else greedy, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)

    prompt = tok.encode(DEFAULT_PROMPT)[:PROMPT_TOKENS]
    decode_tps = max(timed(prompt, greedy).decode_rate for _ in range(cfg.repeats))
    if cfg.decode_only:
        return EngineResult("tokenloop", decode_tps)
    prefill_ids = _prefill_prompt(tok.encode, cfg.prefill_tokens)
    prefill_s = min(
        timed(prefill_ids, SamplingParams(temperature=0, max_tokens=1)).prefill_s for _ in range(cfg.repeats)
    )
    batch = {str(size): max(batch_rate(size) for _ in range(cfg.repeats)) for size in cfg.batch_sizes}
    sampled = max(batch_rate(max(cfg.batch_sizes), sampled=True) for _ in range(cfg.repeats))
    model = engine.runner.model
    return EngineResult(
        "tokenloop",
        decode_tps,
        cfg.prefill_tokens / prefill_s,
        prefill_s * 1e3,
        batch,
        weight_bytes=decode_weight_bytes(model),
        sampled_batch_tps=sampled,
    )


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every parameter and int4 buffer once (a tied head is one
    tensor). Rotary tables are left out: a step reads one row of them."""
    from tokenloop.models.quant import QuantizedModule

    tensors = {id(p): p for p in model.parameters()}
    for m in model.modules():
        if isinstance(m, QuantizedModule):
            tensors |= {id(t): t for t in m.buffers()}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _bench_llamacpp(cfg: BenchConfig) -> EngineResult:
    from llama_cpp import Llama

    llm = Llama(cfg.model, n_ctx=4096, n_batch=512, n_threads=cfg.threads, n_threads_batch=cfg.threads, verbose=False)
    ban_eos = {llm.token_eos(): -1e9}

    def timed(prompt: list[int], max_tokens: int) -> tuple[float, float, int]:
        llm.reset()  # llama-cpp-python reuses a matching prefix of the previous call: start cold every time
        start = time.perf_counter()
        first = last = None
        n = 0
        for _ in llm.create_completion(prompt, max_tokens=max_tokens, temperature=0, stream=True, logit_bias=ban_eos):
            last = time.perf_counter()
            first = first or last
            n += 1
        return first - start, last - first, n

    prompt = llm.tokenize(DEFAULT_PROMPT.encode(), add_bos=False)[:PROMPT_TOKENS]
    decode_tps = max(
        (n - 1) / decode_s for _, decode_s, n in (timed(prompt, cfg.decode_tokens) for _ in range(cfg.repeats))
    )
    prefill_ids = _prefill_prompt(lambda s: llm.tokenize(s.encode(), add_bos=False), cfg.prefill_tokens)
    ttft = min(timed(prefill_ids, 1)[0] for _ in range(cfg.repeats))
    return EngineResult(
        "llama-cpp-python", decode_tps, cfg.prefill_tokens / ttft, ttft * 1e3, weight_bytes=os.path.getsize(cfg.model)
    )


def _bench_llama_bench(cfg: BenchConfig) -> EngineResult:
    from tokenloop.bench.peers import llama_cpp_bin, run_llama_bench

    prefill_tokens = 0 if cfg.decode_only else cfg.prefill_tokens
    r = run_llama_bench(
        llama_cpp_bin(cfg.llama_cpp_bin), cfg.model, cfg.threads, prefill_tokens, cfg.decode_tokens, cfg.repeats
    )
    if cfg.decode_only:
        return EngineResult("llama-bench", r.decode_tps)
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # llama-bench's own, not this process's
    return EngineResult(
        "llama-bench",
        r.decode_tps,
        r.prefill_tps,
        cfg.prefill_tokens / r.prefill_tps * 1e3,
        peak_rss_mib=rss,
        weight_bytes=os.path.getsize(cfg.model),
        note=f"{r.build}; -t {cfg.threads} -p {cfg.prefill_tokens} -n {cfg.decode_tokens} -r {cfg.repeats}",
    )


def _bench_transformers(cfg: BenchConfig) -> EngineResult:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.dirname(cfg.model), os.path.basename(cfg.model)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)

    def run(ids: list[int], max_new: int) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(
                torch.tensor([ids]), max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, pad_token_id=0
            )
        return time.perf_counter() - start

    prompt = tok.encode(DEFAULT_PROMPT, add_special_tokens=False)[:PROMPT_TOKENS]
    run(prompt, 2)
    prefill_ids = _prefill_prompt(lambda s: tok.encode(s, add_special_tokens=False), cfg.prefill_tokens)
    ttft = min(run(prefill_ids, 1) for _ in range(cfg.repeats))
    decode_s = min(run(prompt, cfg.decode_tokens) for _ in range(cfg.repeats)) - min(
        run(prompt, 1) for _ in range(cfg.repeats)
    )
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return EngineResult(
        "transformers",
        (cfg.decode_tokens - 1) / decode_s,
        cfg.prefill_tokens / ttft,
        ttft * 1e3,
        weight_bytes=weight_bytes,
    )


def run_engine(engine: str, cfg: BenchConfig) -> EngineResult:
    """Run one engine in a fresh subprocess; its peak RSS is read there."""
    cmd = [sys.executable, "-m", "tokenloop.bench.offline", engine, json.dumps(asdict(cfg))]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return EngineResult(engine, error=(proc.stderr.strip().splitlines() or ["failed"])[-1][:200])
    return EngineResult(**json.loads(proc.stdout.strip().splitlines()[-1]))


def best_of_rounds(
    runs: list[tuple[str, BenchConfig]],
    repeats: int,
    statistic: str = "best",
    after_round: Callable[[], object] | None = None,
) -> list[EngineResult]:
    """Each (engine, its config)'s figures over `repeats` rounds (`statistic`: their best or their median), a round
    running every engine once in turn, then `after_round`."""
    rounds = []
    for _ in range(repeats):
        rounds.append([run_engine(engine, replace(cfg, repeats=1)) for engine, cfg in runs])
        if after_round is not None:
            after_round()
    return [best_result(list(results), statistic) for results in zip(*rounds)]


def summary(values: list[float], statistic: str, pick=max) -> float:
    """Repeated measurements as one figure: their median (`statistic` "median"), else the best by `pick`."""
    return statistics.median(values) if statistic == "median" else pick(values)


def best_result(runs: list[EngineResult], statistic: str = "best") -> EngineResult:
    """One engine's runs as one result: the highest rates and the shortest time to first token (`statistic`
    "median": the median of each), the highest peak RSS (the memory it needs); a failed run, if any, instead."""
    if failed := next((r for r in runs if r.error is not None), None):
        return failed

    def best(field: str, pick=max):
        values = [getattr(r, field) for r in runs if getattr(r, field) is not None]
        return summary(values, statistic, pick) if values else None

    batches = [r.batch_tps for r in runs if r.batch_tps]
    batch = {size: summary([b[size] for b in batches], statistic) for size in batches[0]} if batches else None
    return replace(
        runs[0],
        decode_tps=best("decode_tps"),
        prefill_tps=best("prefill_tps"),
        ttft_ms=best("ttft_ms", min),
        batch_tps=batch,
        peak_rss_mib=max((r.peak_rss_mib for r in runs if r.peak_rss_mib is not None), default=None),
        busy_decode_tps=best("busy_decode_tps"),
        sampled_batch_tps=best("sampled_batch_tps"),
    )


def memory_bandwidth_gbs() -> float:
    """Copy bandwidth of a 512 MiB tensor (bytes read + written per second): the ceiling for a decode step. In
    huge pages where the system has them, as the weights are (a 4 KiB-paged copy reads a few percent lower). In a
    child process: its 1 GiB of buffers would be this process's peak RSS, which every engine child started after
    it would report as its own (Linux keeps the peak across fork and exec)."""
    code = "from tokenloop.bench.offline import _copy_gbs; print(_copy_gbs())"
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def _copy_gbs() -> float:
    src = torch.empty(128 * 2**20)
    dst = torch.empty_like(src)
    advise_huge_pages([src, dst])
    src.fill_(1)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    return 5 * 2 * src.numel() * 4 / (time.perf_counter() - start) / 1e9


def format_table(results: list[EngineResult], cfg: BenchConfig, bandwidth: float) -> str:
    ours = results[0]
    # (label, tokenloop's figure, the peer's figure); the peers decode one sequence at a time, so a batched row
    # sets tokenloop's batch against the peer's single stream: what the peer gives that many users, one by one.
    rows = [
        ("single-stream decode, tokens/s", lambda r: r.decode_tps, lambda r: r.decode_tps),
        (f"prefill of {cfg.prefill_tokens} tokens, tokens/s", lambda r: r.prefill_tps, lambda r: r.prefill_tps),
        (f"time to first token ({cfg.prefill_tokens} tokens), ms", lambda r: r.ttft_ms, lambda r: r.ttft_ms),
    ]
    rows += [
        (
            f"{b} concurrent × {cfg.decode_tokens} tokens, tokens/s",
            lambda r, b=b: (r.batch_tps or {}).get(str(b)),
            lambda r: r.decode_tps,
        )
        for b in cfg.batch_sizes
    ]
    largest = max(cfg.batch_sizes)
    settings = f"T {SAMPLED['temperature']} top-p {SAMPLED['top_p']}"
    rows.append((f"{largest} concurrent, {settings}, tokens/s", lambda r: r.sampled_batch_tps, lambda r: r.decode_tps))
    gbs = lambda r: r.decode_tps and r.weight_bytes and r.decode_tps * r.weight_bytes / 1e9  # noqa: E731
    rows += [
        ("single-stream decode, one core busy, tokens/s", lambda r: r.busy_decode_tps, lambda r: r.busy_decode_tps),
        ("peak RSS, MiB", lambda r: r.peak_rss_mib, lambda r: r.peak_rss_mib),
        (f"decode GB/s (memory copy: {bandwidth:.1f} GB/s)", gbs, gbs),
    ]
    peers = results[1:]
    widths = [max(14, len(r.engine) + 2) for r in peers]
    header = f"{'':48}{'tokenloop':>12}" + "".join(f"{r.engine:>{w}}{'ratio':>8}" for r, w in zip(peers, widths))
    lines = [f"tokenloop bench: {os.path.basename(cfg.model)}, dtype {cfg.dtype}, {cfg.threads} threads", header]
    for label, get, get_peer in rows:
        line = f"{label:48}{_fmt(get(ours)):>12}"
        for r, w in zip(peers, widths):
            mine, theirs = get(ours), get_peer(r)
            ratio = f"{mine / theirs:.2f}x" if mine and theirs else "-"
            line += f"{_fmt(theirs):>{w}}{ratio:>8}"
        lines.append(line)
    greedy_batch = (ours.batch_tps or {}).get(str(largest))
    if ours.sampled_batch_tps and greedy_batch:
        ratio = ours.sampled_batch_tps / greedy_batch
        lines.append(f"sampled ({settings}) / greedy at {largest} concurrent: {ratio:.2f}x")
    lines += [f"{r.engine}: {r.error}" for r in results if r.error]
    lines += [f"{r.engine}: {r.note}" for r in results if r.note]
    timing = (
        f"the {cfg.statistic} of {cfg.repeats} runs, in rounds of one run per engine and a memory copy"
        if cfg.repeats > 1
        else "one run"
    )
    lines.append(f"ratio = tokenloop / peer; each timed figure is {timing} (llama-bench: one repetition a run).")
    lines.append("The peers run one sequence at a time: a concurrent row's peer figure is its single-stream decode.")
    return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", "-m", default=None, help="known name or .gguf file (default: the default model)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--compile", action=argparse.BooleanOptionalAction, default=True, help="tokenloop's compiled decode step"
    )
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--prefill-tokens", type=int, default=1024)
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma-separated subset of " + ", ".join(ENGINES))
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help=(
            "each timed figure is the best of this many runs "
            "(--speculative: each ratio the median of this many paired runs)"
        ),
    )
    parser.add_argument(
        "--median",
        action="store_true",
        help="each timed figure is the median of the --repeats runs instead of their best",
    )
    parser.add_argument(
        "--busy-core",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also decode while another process keeps one core busy",
    )
    parser.add_argument(
        "--speculative",
        action="store_true",
        help="speculative decoding (n-gram lookup, 4-bit draft for float32) against tokenloop's own decode without it",
    )
    parser.add_argument(
        "--llama-cpp-bin",
        default=None,
        help="a folder with llama.cpp's llama-bench and llama-server (default: built once into $TOKENLOOP_HOME/peers)",
    )
    record.add_argument(parser)


def main_from_args(args: argparse.Namespace) -> int:
    from tokenloop.models.store import resolve

    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.speculative:
        from tokenloop.bench import speculative
        from tokenloop.models.eagle import shipped_drafter

        try:
            drafter = str(shipped_drafter(args.model))
        except ValueError:
            drafter = None  # no EAGLE drafter ships for this model: its rows are left out
        table = speculative.report(str(resolve(args.model)), args.decode_tokens, args.repeats, drafter)
        print(table)
        if args.record:
            record.save("speculative", table)
        return 0
    cfg = BenchConfig(
        str(resolve(args.model)),
        args.dtype,
        args.compile,
        args.threads,
        args.decode_tokens,
        args.prefill_tokens,
        repeats=args.repeats,
        statistic="median" if args.median else "best",
        llama_cpp_bin=args.llama_cpp_bin,
    )
    engines = ["tokenloop"] + [e for e in args.engines.split(",") if e in ENGINES and e != "tokenloop"]
    if cfg.compile:
        build_compiled_package(cfg.model, cfg.dtype)
    # The copy once a round, in the same spells as the decodes it is held against (a shared machine's copy speed
    # moves with its neighbours' load), summarised as they are.
    copies: list[float] = []
    results = best_of_rounds(
        [(e, cfg) for e in engines], cfg.repeats, cfg.statistic, lambda: copies.append(memory_bandwidth_gbs())
    )
    if args.busy_core:
        add_busy_core_decode(results, cfg)
    table = format_table(results, cfg, summary(copies, cfg.statistic))
    print(table)
    if args.record:
        record.save("offline", table)
    return 0


def add_busy_core_decode(results: list[EngineResult], cfg: BenchConfig) -> None:
    """Single-stream decode of tokenloop (its default thread choice) and llama-bench (the same -t) while a
    Python loop keeps one core busy."""
    measured = [r for r in results if r.engine in ("tokenloop", "llama-bench") and r.error is None]
    runs = [
        (r.engine, replace(cfg, threads=None if r.engine == "tokenloop" else cfg.threads, decode_only=True))
        for r in measured
    ]
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(1)
        for r, busy in zip(measured, best_of_rounds(runs, cfg.repeats, cfg.statistic)):
            r.busy_decode_tps = busy.decode_tps
    finally:
        hog.kill()


def _child(engine: str, cfg_json: str) -> None:
    cfg = BenchConfig(**{**json.loads(cfg_json), "batch_sizes": tuple(json.loads(cfg_json)["batch_sizes"])})
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    bench = {
        "tokenloop": _bench_tokenloop,
        "llama-bench": _bench_llama_bench,
        "llama-cpp-python": _bench_llamacpp,
        "transformers": _bench_transformers,
    }[engine]
    result = bench(cfg)
    if result.peak_rss_mib is None:
        result.peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(asdict(result)))


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
