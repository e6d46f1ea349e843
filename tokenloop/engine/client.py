"""EngineClient: what the server asks of the engine it serves from, whichever runs the steps: AsyncEngine (one
process, a step thread) or DisaggregatedEngine (prefill and decode worker processes, disaggregation/)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Protocol

from tokenloop.engine.async_engine import AsyncEngineConfig
from tokenloop.engine.beam_search import BeamSearchParams
from tokenloop.engine.config import EngineConfig
from tokenloop.engine.input_processor import InputProcessor, ProcessedPrompt, Prompt
from tokenloop.engine.input_threads import InputThreads
from tokenloop.engine.lora import LoRARequest
from tokenloop.engine.metrics import EngineMetrics
from tokenloop.models.loader import load_config, load_tokenizer
from tokenloop.outputs import RequestOutput
from tokenloop.sampling.params import SamplingParams


class EngineClient(Protocol):
    config: AsyncEngineConfig
    inputs: InputProcessor
    input_threads: InputThreads
    metrics: EngineMetrics
    draining: bool
    death: BaseException | None  # why the engine stopped for good (the server then exits)
    on_death: Callable[[BaseException], None] | None

    @property
    def num_in_flight(self) -> int: ...

    async def admit_and_process(
        self, prompts: list[Prompt], params: SamplingParams | BeamSearchParams, lora: LoRARequest | None = None
    ) -> list[ProcessedPrompt]: ...

    def generate(
        self,
        prompt: Prompt | ProcessedPrompt,
        params: SamplingParams | BeamSearchParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]: ...

    def health(self) -> dict:
        """{"status": "ok" or why not, ...}: /health's body (the server says "draining" itself)."""
        ...

    def abort_all(self) -> None: ...

    def shutdown(self) -> None: ...


def remote_inputs(config: EngineConfig) -> InputProcessor:
    """The InputProcessor of a frontend whose engines run elsewhere (worker processes, replicas): the engines'
    tokenizer and limits, from their config, without their weights."""
    model = load_config(config.model)
    return InputProcessor(
        load_tokenizer(config.model), model.vocab_size, config.context_length(model), config.kv_cache_tokens(model)
    )
