"""`tokenloop bench` on the tiny model: every figure is measured, in a subprocess, and the table shows ratios."""

from __future__ import annotations

from tokenloop.bench.offline import BenchConfig, EngineResult, format_table, run_engine


def test_tokenloop_figures_are_measured_in_a_subprocess(tiny_model_folder):
    cfg = BenchConfig(
        str(tiny_model_folder),
        dtype="float32",
        compile=False,
        threads=1,
        decode_tokens=8,
        prefill_tokens=64,
        batch_sizes=(2,),
        repeats=2,
    )
    result = run_engine("tokenloop", cfg)
    assert result.error is None
    assert result.decode_tps > 0 and result.prefill_tps > 0 and result.ttft_ms > 0
    assert result.batch_tps["2"] > 0 and result.peak_rss_mib > 0 and result.weight_bytes > 0


def test_an_engine_that_fails_reports_its_error(tiny_model_folder):
    cfg = BenchConfig(str(tiny_model_folder / "missing.gguf"), threads=1)
    assert run_engine("tokenloop", cfg).error


def test_the_table_prints_tokenloop_over_peer_ratios():
    cfg = BenchConfig("m.gguf", batch_sizes=(8,))
    ours = EngineResult(
        "tokenloop",
        decode_tps=20.0,
        prefill_tps=300.0,
        ttft_ms=10.0,
        batch_tps={"8": 80.0},
        peak_rss_mib=100.0,
        weight_bytes=10**8,
        sampled_batch_tps=72.0,
    )
    peer = EngineResult(
        "llama-bench", decode_tps=10.0, prefill_tps=100.0, ttft_ms=20.0, peak_rss_mib=50.0, weight_bytes=10**8
    )
    table = format_table([ours, peer], cfg, bandwidth=20.0)
    decode = next(line for line in table.splitlines() if line.startswith("single-stream decode"))
    assert decode.split()[-2:] == ["10.0", "2.00x"]
    batched = next(line for line in table.splitlines() if line.startswith("8 concurrent"))
    assert batched.split()[-2:] == ["10.0", "8.00x"]  # against the peer's single stream: it serves one at a time
    assert "decode GB/s (memory copy: 20.0 GB/s)" in table
    sampled = next(line for line in table.splitlines() if line.startswith("8 concurrent, T 0.8 top-p 0.95, tokens/s"))
    assert sampled.split()[-2:] == ["10.0", "7.20x"]
    assert "sampled (T 0.8 top-p 0.95) / greedy at 8 concurrent: 0.90x" in table


def test_runs_go_in_rounds_of_one_run_per_engine(monkeypatch):
    """Every engine once a round, in turn, each run a single repetition: a slow spell of the machine falls on all."""
    from tokenloop.bench import offline

    calls = []

    def run(engine, cfg):
        calls.append((engine, cfg.repeats))
        return EngineResult(engine, decode_tps=float(len(calls)))

    monkeypatch.setattr(offline, "run_engine", run)
    cfg = BenchConfig("m.gguf")
    results = offline.best_of_rounds(
        [("tokenloop", cfg), ("llama-bench", cfg)], repeats=3, after_round=lambda: calls.append(("copy", None))
    )
    assert calls == [("tokenloop", 1), ("llama-bench", 1), ("copy", None)] * 3
    assert [r.decode_tps for r in results] == [7.0, 8.0]  # each engine's best: its last round here


def test_the_memory_copy_leaves_this_process_its_peak_rss():
    """The copy's 1 GiB runs in a child: Linux hands a process's peak RSS on to every child it starts after."""
    import resource

    from tokenloop.bench.offline import memory_bandwidth_gbs

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert memory_bandwidth_gbs() > 0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 256 * 1024  # KiB


def test_an_engines_runs_give_its_best_figures():
    from tokenloop.bench.offline import best_result

    runs = [
        EngineResult("e", decode_tps=10.0, prefill_tps=90.0, ttft_ms=30.0, batch_tps={"8": 5.0}, peak_rss_mib=100.0),
        EngineResult("e", decode_tps=12.0, prefill_tps=80.0, ttft_ms=20.0, batch_tps={"8": 7.0}, peak_rss_mib=90.0),
    ]
    best = best_result(runs)
    assert (best.decode_tps, best.prefill_tps, best.ttft_ms, best.batch_tps, best.peak_rss_mib) == (
        12.0,
        90.0,
        20.0,
        {"8": 7.0},
        100.0,
    )
    assert best_result([*runs, EngineResult("e", error="boom")]).error == "boom"


def test_the_median_statistic_takes_each_figures_median_and_the_highest_rss():
    from tokenloop.bench.offline import best_result

    runs = [
        EngineResult("e", decode_tps=d, ttft_ms=t, batch_tps={"32": b}, peak_rss_mib=m)
        for d, t, b, m in [(10.0, 30.0, 5.0, 100.0), (30.0, 10.0, 9.0, 90.0), (12.0, 50.0, 7.0, 95.0)]
    ]
    median = best_result(runs, "median")
    assert (median.decode_tps, median.ttft_ms, median.batch_tps, median.peak_rss_mib) == (
        12.0,
        30.0,
        {"32": 7.0},
        100.0,
    )
