"""Stream one request's text from an engine as it is produced, timing its prefill and decode."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

from tokenloop.engine.input_processor import Prompt
from tokenloop.engine.llm_engine import LLMEngine
from tokenloop.sampling.params import SamplingParams


@dataclass(slots=True)
class StreamStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    prefill_s: float = 0.0  # request start → first token
    decode_s: float = 0.0  # first token → last token

    @property
    def prefill_rate(self) -> float:
        """Prompt tokens computed (not served from the prefix cache) per second."""
        return (self.prompt_tokens - self.cached_tokens) / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_rate(self) -> float:
        """Tokens per second after the first one."""
        return (self.output_tokens - 1) / self.decode_s if self.decode_s else 0.0

    def summary(self) -> str:
        return (
            f"prompt: {self.prompt_tokens} tokens ({self.cached_tokens} cached), {self.prefill_rate:.1f} tokens/s | "
            f"decode: {self.output_tokens} tokens, {self.decode_rate:.1f} tokens/s"
        )


def stream(engine: LLMEngine, prompt: Prompt, params: SamplingParams, stats: StreamStats) -> Iterator[str]:
    """Yield the text of one request as it is produced; aborts the request if the consumer stops early."""
    start = time.perf_counter()
    request_id = engine.add_request(prompt, params)
    shown, first = 0, None
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id != request_id:
                    continue
                if out.error:
                    raise RuntimeError(f"the request failed: {out.error}")
                now = time.perf_counter()
                if first is None:
                    first = now
                    stats.prefill_s = now - start
                    stats.prompt_tokens, stats.cached_tokens = len(out.prompt_token_ids), out.num_cached_tokens
                stats.output_tokens, stats.decode_s = len(out.outputs[0].token_ids), now - first
                text = out.outputs[0].text
                if len(text) > shown:
                    yield text[shown:]
                    shown = len(text)
    finally:
        engine.abort_request(request_id)  # no-op once finished; frees the blocks on Ctrl-C
