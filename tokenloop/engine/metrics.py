"""Prometheus metrics of a serving engine: latencies per request, and the scheduler's and KV cache's state."""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tokenloop.engine.llm_engine import LLMEngine
from tokenloop.outputs import RequestOutput
from tokenloop.spec_decode.speculator import SpecStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)


class StreamTimes(Protocol):
    arrival: float  # perf_counter at arrival
    tokens: int  # output tokens so far
    last_token: float  # perf_counter at the latest output


class EngineMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram(
            "tokenloop_time_to_first_token_seconds",
            "Request arrival to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "tokenloop_inter_token_latency_seconds",
            "Time between two tokens of a request",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "tokenloop_e2e_request_latency_seconds",
            "Request arrival to its last token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.running = Gauge("tokenloop_num_requests_running", "Sequences in the running batch", registry=r)
        self.waiting = Gauge("tokenloop_num_requests_waiting", "Sequences waiting to be scheduled", registry=r)
        self.paused = Gauge(
            "tokenloop_num_requests_paused", "Sequences paused until their reader catches up", registry=r
        )
        self.blocks_used = Gauge("tokenloop_kv_cache_blocks_in_use", "KV blocks referenced by sequences", registry=r)
        self.blocks_total = Gauge("tokenloop_kv_cache_blocks_total", "KV blocks in the pool", registry=r)
        self.window_released = Counter(
            "tokenloop_kv_cache_window_released_blocks",
            "KV blocks sliding-window layer groups gave back, wholly before their window",
            registry=r,
        )
        self.prefix_hit_rate = Gauge(
            "tokenloop_prefix_cache_hit_rate",
            "Prompt tokens served from the prefix cache / prompt tokens looked up",
            registry=r,
        )
        self.prompt_tokens = Counter("tokenloop_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("tokenloop_generation_tokens", "Generated tokens", registry=r)
        self.preemptions = Counter("tokenloop_num_preemptions", "Sequences preempted for lack of KV blocks", registry=r)
        self._preemptions_seen = self._released_seen = 0
        # Speculative decoding (vLLM's names, tokenloop's prefix): counters of the speculator's totals.
        self.spec_drafts = Counter(
            "tokenloop_spec_decode_num_drafts", "Drafts verified (sequence-steps with draft tokens)", registry=r
        )
        self.spec_draft_tokens = Counter(
            "tokenloop_spec_decode_num_draft_tokens", "Draft tokens proposed and verified", registry=r
        )
        self.spec_accepted_tokens = Counter(
            "tokenloop_spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r
        )
        self.spec_accepted_per_pos = Counter(
            "tokenloop_spec_decode_num_accepted_tokens_per_pos",
            "Drafts whose token at this position was accepted",
            ["position"],
            registry=r,
        )
        self.spec_mean_accepted_length = Gauge(
            "tokenloop_spec_decode_mean_accepted_length",
            "Tokens per verifying step (accepted draft tokens + 1), since the start",
            registry=r,
        )
        self.spec_draft_length = Gauge(
            "tokenloop_spec_decode_draft_length",
            "Mean draft length the cost model chose in the latest step",
            registry=r,
        )
        self.spec_draft_seconds = Counter(
            "tokenloop_spec_decode_draft_seconds", "Seconds the proposer spent drafting", registry=r
        )
        self.spec_draft_ms_per_step = Gauge(
            "tokenloop_spec_decode_draft_ms_per_step",
            "Milliseconds the proposer spent per step it drafted in, since the start",
            registry=r,
        )
        self._spec_seen = SpecStats()

    def observe_output(self, stream: StreamTimes, out: RequestOutput, now: float) -> None:
        """A request's new output (cumulative) at time `now`: its tokens, time to first token, inter-token latency
        and, finished, end-to-end latency; `stream` keeps the request's times (arrival, tokens, last_token)."""
        if out.error:
            return
        tokens = sum(len(c.token_ids) for c in out.outputs)
        self.generation_tokens.inc(tokens - stream.tokens)
        if stream.tokens == 0:
            self.ttft.observe(now - stream.arrival)
        else:
            self.itl.observe(now - stream.last_token)
        stream.tokens, stream.last_token = tokens, now
        if out.finished:
            self.e2e.observe(now - stream.arrival)

    def observe_engine(self, engine: LLMEngine) -> None:
        """Read the scheduler's and block manager's state after a step (or an abort)."""
        scheduler, blocks = engine.scheduler, engine.block_manager
        self.running.set(len(scheduler.running))
        self.waiting.set(len(scheduler.waiting))
        self.paused.set(len(scheduler.paused))
        self.blocks_used.set(blocks.num_used_blocks)
        self.blocks_total.set(blocks.num_blocks)
        self.window_released.inc(blocks.num_released_blocks - self._released_seen)
        self._released_seen = blocks.num_released_blocks
        if blocks.prefix_queried_tokens:
            self.prefix_hit_rate.set(blocks.prefix_hit_tokens / blocks.prefix_queried_tokens)
        self.preemptions.inc(scheduler.num_preemptions - self._preemptions_seen)
        self._preemptions_seen = scheduler.num_preemptions
        if engine.speculator is not None:
            self._observe_speculation(engine.speculator.stats)

    def _observe_speculation(self, stats: SpecStats) -> None:
        seen = self._spec_seen
        self.spec_drafts.inc(stats.num_drafts - seen.num_drafts)
        self.spec_draft_tokens.inc(stats.num_draft_tokens - seen.num_draft_tokens)
        self.spec_accepted_tokens.inc(stats.num_accepted_tokens - seen.num_accepted_tokens)
        for position, count in enumerate(stats.accepted_per_position):
            before = seen.accepted_per_position[position] if position < len(seen.accepted_per_position) else 0
            self.spec_accepted_per_pos.labels(position=str(position)).inc(count - before)
        if stats.num_drafts:
            self.spec_mean_accepted_length.set(1 + stats.num_accepted_tokens / stats.num_drafts)
        self.spec_draft_length.set(stats.last_chosen)
        self.spec_draft_seconds.inc(stats.draft_seconds - seen.draft_seconds)
        self.spec_draft_ms_per_step.set(stats.draft_ms_per_step)
        self._spec_seen = replace(stats, accepted_per_position=list(stats.accepted_per_position))
