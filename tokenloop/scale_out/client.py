"""ReplicaSetClient: the server's engine (EngineClient) when the engines are Ray Serve replicas.

It runs in the ingress deployment, under the same OpenAI-compatible app as a single engine (server/app.py):
prompts are processed here, hashed into their blocks' chain hashes (as every replica's block manager hashes them),
and sent through the replicas' deployment handle, whose router (scale_out/routers.py) picks the replica. The
router's predicted hit is counted beside the replica's actual one (its first output's cached prompt tokens).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

from prometheus_client import Counter

from tokenloop.engine.async_engine import Admission, AsyncEngineConfig, RequestFailed
from tokenloop.engine.beam_search import BeamSearchParams
from tokenloop.engine.block_manager import BlockHasher, block_identity
from tokenloop.engine.client import remote_inputs
from tokenloop.engine.config import EngineConfig
from tokenloop.engine.input_processor import ProcessedPrompt, Prompt
from tokenloop.engine.input_threads import InputThreads
from tokenloop.engine.lora import LoRARequest
from tokenloop.engine.metrics import EngineMetrics
from tokenloop.models import store
from tokenloop.models.lora import adapter_identity
from tokenloop.outputs import RequestOutput
from tokenloop.sampling.params import SamplingParams
from tokenloop.scale_out.routers import RouteNote


class _Stream:
    """A request's times, for EngineMetrics.observe_output."""

    def __init__(self, arrival: float) -> None:
        self.arrival, self.tokens, self.last_token = arrival, 0, 0.0


class ReplicaSetClient(Admission):
    def __init__(self, engine_config: EngineConfig, handle, limits: AsyncEngineConfig, router: str) -> None:
        self.config, self.router = limits, router
        self.handle = handle.options(stream=True)
        self.inputs = remote_inputs(engine_config)
        self.input_threads = InputThreads()
        self.input_threads.submit(self.inputs.warm)
        identity = block_identity(store.resolve(engine_config.model), engine_config.dtype, engine_config.kv_dtype)
        self.hasher = BlockHasher(engine_config.block_size, identity)
        self.metrics = EngineMetrics()
        r = self.metrics.registry
        self.routed_prompt_tokens = Counter(
            "tokenloop_router_prompt_tokens", "Prompt tokens of the routed requests", ["router"], registry=r
        )
        self.predicted_hits = Counter(
            "tokenloop_router_predicted_hit_tokens", "Prompt tokens the router expected cached", ["router"], registry=r
        )
        self.actual_hits = Counter(
            "tokenloop_router_actual_hit_tokens", "Prompt tokens the replica had cached", ["router"], registry=r
        )
        self.draining, self.death, self.on_death = False, None, None
        self.num_waiting = 0
        self._responses: set = set()
        self._adapters: dict[str, bytes] = {}

    @property
    def num_in_flight(self) -> int:
        return len(self._responses)

    def health(self) -> dict:
        return {"status": "ok", "router": self.router}

    def _extra_key(self, lora: LoRARequest | None) -> bytes:
        """The adapter's identity, as the replicas' block managers hash it (BlockManager.lora_key)."""
        if lora is None:
            return b""
        if lora.path not in self._adapters:
            self._adapters[lora.path] = adapter_identity(Path(lora.path)).encode()
        return self._adapters[lora.path]

    async def generate(
        self,
        prompt: Prompt | ProcessedPrompt,
        params: SamplingParams | BeamSearchParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """AsyncEngine.generate's stream, the request run on the replica the router picks."""
        loop = asyncio.get_running_loop()
        self.num_waiting += 1
        started, finished, last, response = False, False, None, None
        stream = _Stream(loop.time())
        try:
            if not isinstance(prompt, ProcessedPrompt):
                prompt = await self.input_threads.run(self.inputs.process, prompt, params or SamplingParams())
            note = RouteNote()
            hashes = self.hasher.prompt_hashes(prompt.prompt_token_ids, self._extra_key(prompt.lora_request))
            response = self.handle.generate.remote(prompt, block_hashes=hashes, route=note)
            self._responses.add(response)
            try:
                async for out in response:
                    if out.error:
                        raise RequestFailed(out.error)
                    if not started:
                        started = True
                        self.num_waiting -= 1
                        self._count_hits(note, prompt, out)
                    self.metrics.observe_output(stream, out, loop.time())
                    finished, last = out.finished, out
                    yield out
            except asyncio.CancelledError:
                if last is None or finished:
                    raise
                yield _aborted(last)  # abort_all: the request ends as the server's drain ends it
                finished = True
            except RequestFailed:
                raise
            except Exception as e:  # a replica that died, a call Ray could not make
                raise RequestFailed(f"the replica failed this request: {type(e).__name__}: {e}") from None
        finally:
            if not started:
                self.num_waiting -= 1
            if response is not None:
                self._responses.discard(response)
                if not finished:
                    response.cancel()

    def _count_hits(self, note: RouteNote, prompt: ProcessedPrompt, out: RequestOutput) -> None:
        predicted = note.predicted_blocks
        if predicted is None:  # a router that predicts nothing (pow2)
            return
        self.routed_prompt_tokens.labels(router=self.router).inc(len(prompt.prompt_token_ids))
        self.predicted_hits.labels(router=self.router).inc(predicted * self.hasher.block_size)
        self.actual_hits.labels(router=self.router).inc(out.num_cached_tokens)

    def abort_all(self) -> None:
        for response in list(self._responses):
            response.cancel()

    def shutdown(self) -> None:
        self.input_threads.shutdown()


def _aborted(last: RequestOutput) -> RequestOutput:
    outputs = [c if c.finish_reason else replace(c, finish_reason="abort") for c in last.outputs]
    return replace(last, outputs=outputs, finished=True)
