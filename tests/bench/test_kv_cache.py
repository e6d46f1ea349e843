"""`tokenloop bench kv` on the tiny model: both caches measured, in child processes, and the report's ratios."""

from __future__ import annotations

from tokenloop.bench.kv_cache import KVBenchConfig, format_report, measure


def test_the_int8_cache_is_measured_against_the_16_bit_one(tiny_model_folder):
    cfg = KVBenchConfig(
        str(tiny_model_folder),
        long_prompt_tokens=120,
        decode_tokens=4,
        perplexity_tokens=200,
        perplexity_window=64,
        rounds=1,
        compile=False,
    )
    quality, speed = measure(cfg)
    base, int8 = quality["auto"], quality["int8"]
    assert base.scored_tokens == int8.scored_tokens > 0 and base.perplexity > 1 and int8.perplexity > 1
    assert 1.7 < int8.pool_tokens / base.pool_tokens < 2 and int8.cache_dtype == "int8"  # head_dim 16: 32 / 18 bytes
    assert len(base.parity_tokens) == len(int8.parity_tokens) > 0
    assert all(s.long_decode_tps > 0 and s.short_decode_tps > 0 for s in speed.values())
    # One KV cache group (every layer attends to everything): the request holds a block per 16 tokens it computed.
    assert all(s.long_kv_mib == s.long_kv_every_layer_mib > 0 for s in speed.values())
    report = format_report(cfg, quality, speed)
    assert "tokens in a 1 GiB pool" in report and f"{int8.pool_tokens / base.pool_tokens:.2f}x" in report
    assert "decode after 120 prompt tokens" in report and "on the parity prompts" in report
    assert "KV held by the 120-token request" in report
