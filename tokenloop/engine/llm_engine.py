"""LLMEngine: add_request / abort_request / step over a scheduler, a KV block manager and a model runner.

One step: the scheduler picks sequences and token counts (integers), the executor runs them through the model
(tensors), the output processor turns samples into tokens, text and stops, the scheduler steps its sequences on,
and each request's kind (engine/requests.py) forks or ends sequences and gives its output.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import replace

import torch

from tokenloop.engine.beam_search import BeamSearchParams
from tokenloop.engine.block_manager import NULL_BLOCK, BlockManager, block_identity
from tokenloop.engine.config import EngineConfig, compile_spec
from tokenloop.engine.executor import StepExecutor, StepResult
from tokenloop.engine.faults import FaultInjection
from tokenloop.engine.host_memory import keep_freed_memory
from tokenloop.engine.input_processor import InputProcessor, ProcessedPrompt, Prompt
from tokenloop.engine.kv_groups import kv_cache_windows
from tokenloop.engine.lora import LoRAManager, LoRARequest, LoRASlot
from tokenloop.engine.model_runner import ModelRunner, zeroed_pool
from tokenloop.engine.output_processor import CompletionState, OutputProcessor
from tokenloop.engine.requests import Fork, Request, new_request
from tokenloop.engine.scheduler import Scheduler
from tokenloop.engine.sequence import Sequence
from tokenloop.engine.shared_pools import SharedPools
from tokenloop.engine.threads import default_threads
from tokenloop.models.loader import load_model
from tokenloop.outputs import RequestOutput
from tokenloop.sampling.params import SamplingParams
from tokenloop.sampling.processors import LogitControls
from tokenloop.tokenizer.detokenizer import IncrementalDetokenizer

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        device = config.torch_device
        threads = config.threads if config.threads is not None else default_threads()
        if threads != torch.get_num_threads():
            if config.threads is None:
                logger.info(
                    "using %d CPU thread(s): other processes keep the other cores busy (--threads sets it)", threads
                )
            torch.set_num_threads(threads)
        loaded = load_model(config.model, config.torch_dtype, device, keep_quantized=config.dtype == "auto")
        if device.type == "cpu":  # after loading: its temporaries are given back as before
            keep_freed_memory()
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.max_model_len = config.context_length(loaded.config)
        num_blocks = config.num_kv_blocks(loaded.config)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_gb={config.kv_cache_gb} does not hold one KV block of this model")
        identity = block_identity(loaded.path, config.dtype, config.kv_dtype)
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching, identity, kv_cache_windows(loaded.config)
        )
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.input_processor = InputProcessor(
            self.tokenizer, loaded.config.vocab_size, self.max_model_len, config.kv_cache_tokens(loaded.config)
        )
        self.loras: LoRAManager | None = None
        compile = config.compile
        if config.enable_lora:
            self.loras = LoRAManager(loaded.model, loaded.config, config.torch_dtype, device)
            for lora in config.lora_modules:
                self.loras.slot(lora)
            compile = False  # the package would hold the wrapped linears' names; adapters' rows run eager anyway
        self.runner = ModelRunner(
            loaded.model,
            loaded.config,
            num_blocks,
            config.block_size,
            config.kv_dtype,
            device,
            compile,
            compile_spec(config, loaded.path) if compile and config.compile_in_background else None,
            self.loras.context if self.loras is not None else None,
            SharedPools(config.kv_shared_memory) if config.kv_shared_memory is not None else zeroed_pool,
        )
        self.speculator = None
        if config.speculative_config is not None:
            from tokenloop.spec_decode.factory import build_speculator

            eos = set(self.tokenizer.eos_token_ids)
            self.speculator = build_speculator(config, self.runner, self.max_model_len, eos, num_blocks)
            self.scheduler.on_finish.append(self.speculator.release)
            self.scheduler.on_fork.append(self.speculator.proposer.fork)
            self.runner.hidden_states = self.speculator.proposer.wants_hidden_states
        faults = [FaultInjection.parse(spec) for spec in config.inject_faults]
        self.executor = StepExecutor(self.runner, faults, threads, adaptive=config.threads is None)
        self.output_processor = OutputProcessor(self.tokenizer, self.max_model_len, self.speculator is not None, faults)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._retained: dict[str, Sequence] = {}  # finished requests' sequences that keep their blocks (retain=True)

    def add_request(
        self,
        prompt: Prompt | ProcessedPrompt,
        params: SamplingParams | BeamSearchParams | None = None,
        request_id: str | None = None,
        retain: bool = False,
        lora_request: LoRARequest | None = None,
        fork_of: Fork | None = None,
    ) -> str:
        """Queue a request: a prompt with its params, or a ProcessedPrompt (InputProcessor.process), which holds
        them. BeamSearchParams make it a beam search (engine/beam_search.py): its one output, at the end, holds
        the best params.n beams, best first. `retain` (n = 1): once it finishes, its sequence keeps its KV blocks,
        for forks to continue it, until release_request. `lora_request`: the adapter it runs (a ProcessedPrompt
        carries its own). `fork_of`: the prompt starts with the first tokens of a finished, retained request and
        starts on its KV blocks, by reference, running its adapter (engine/requests.py Fork)."""
        if not isinstance(prompt, ProcessedPrompt):
            prompt = self.input_processor.process(prompt, params or SamplingParams(), lora_request)
        elif params is not None and params is not prompt.params or lora_request not in (None, prompt.lora_request):
            raise ValueError("a ProcessedPrompt carries its own params and adapter: pass none with it")
        fork = self._fork_point(fork_of, prompt) if fork_of is not None else None
        lora = fork[0].lora if fork is not None else self._lora_slot(prompt.lora_request)
        request = new_request(self._request_id(request_id), prompt, retain, self.tokenizer.eos_token_ids, lora, fork)
        self.requests[request.request_id] = request
        request.start(self)
        return request.request_id

    def _fork_point(self, fork: Fork, prompt: ProcessedPrompt) -> tuple[Sequence, Fork]:
        parent = self.retained(fork.request_id)
        at = parent.num_tokens if fork.at is None else fork.at
        if not 0 < at <= parent.num_tokens:
            raise ValueError(
                f"fork_of: at must be in [1, {parent.num_tokens}] for request {fork.request_id!r}, got {at}"
            )
        if prompt.prompt_token_ids[:at] != parent.token_ids[:at]:
            raise ValueError(
                f"fork_of: the prompt must start with the first {at} tokens of request {fork.request_id!r}"
            )
        return parent, replace(fork, at=at)

    def fork_request(self, request_id: str, suffixes: list[list[int]], params: SamplingParams) -> list[str]:
        """New requests that continue a finished, retained one: each prompt is its tokens (prompt and output)
        followed by a suffix, and starts on its KV blocks, by reference; only the suffix is computed."""
        parent = self.retained(request_id)
        processed = [
            self.input_processor.process({"prompt_token_ids": parent.token_ids + list(suffix)}, params)
            for suffix in suffixes
        ]
        return [self.add_request(prompt, fork_of=Fork(request_id)) for prompt in processed]

    def retained(self, request_id: str) -> Sequence:
        """The sequence of a finished request kept with retain=True."""
        seq = self._retained.get(request_id)
        if seq is None:
            raise ValueError(f"request {request_id!r} is not a finished request kept with retain=True")
        return seq

    def retained_blocks(self, request_id: str) -> list[tuple[int, int, int, int]]:
        """(KV cache group, index, chain hash, block id) of each full, hashed block a finished request kept with
        retain=True holds, group after group, in order: what a decode worker copies from a prefill worker
        (disaggregation/)."""
        seq = self.retained(request_id)
        return [
            (group, i, seq.block_hashes[i], block_id)
            for group, table in enumerate(seq.block_tables)
            for i, block_id in enumerate(table[: len(seq.block_hashes)])
            if block_id != NULL_BLOCK
        ]

    def release_request(self, request_id: str) -> None:
        """Free the blocks a finished, retained request kept."""
        if (seq := self._retained.pop(request_id, None)) is not None:
            self.scheduler.release_kept(seq)

    def _lora_slot(self, request: LoRARequest | None) -> LoRASlot | None:
        if request is None:
            return None
        if self.loras is None:
            raise ValueError(f"adapter {request.name!r} requested, but this engine was built without enable_lora")
        return self.loras.slot(request)

    def keep(self, request_id: str, seq: Sequence) -> None:
        self._retained[request_id] = seq

    def _request_id(self, request_id: str | None) -> str:
        """The caller's id, checked to be free, or a new one."""
        if request_id is None:
            return str(next(self._ids))
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        return request_id

    def new_completion(self, request: Request) -> CompletionState:
        index = len(request.completions)
        params = request.params
        generator = None
        if params.seed is not None:  # completion i of a seeded request uses seed + i, as vLLM does
            generator = torch.Generator(self.config.torch_device).manual_seed(params.seed + index)
        prompt = request.prompt_token_ids
        seq = Sequence(f"{request.request_id}/{index}", list(prompt), len(prompt), params, generator)
        seq.score_prompt = index == 0 and params.prompt_logprobs is not None  # the others share its prompt
        seq.lora = request.lora
        seq.trace = {} if params.trace else None
        seq.controls = LogitControls.for_request(
            params,
            request.output_start if request.output_start is not None else seq.num_prompt_tokens,
            lambda text: self.tokenizer.encode(text, add_special_tokens=False),
            self.tokenizer.eos_token_ids,
            self.input_processor.grammars() if params.structured_outputs is not None else None,
        )
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt, params.stop, params.skip_special_tokens)
        request.completions.append(CompletionState(index, seq, detokenizer))
        return request.completions[-1]

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Drop a request and free its KV blocks at once; returns its last output, every unfinished completion
        ending with finish_reason "abort" (None for unknown or finished ids)."""
        request = self._drop(request_id)
        return None if request is None else self.output_processor.make_output(request, finished=True)

    def _drop(self, request_id: str) -> Request | None:
        request = self.requests.pop(request_id, None)
        for seq in request.live_sequences() if request is not None else []:
            seq.finish_reason = seq.finish_reason or "abort"
            self.scheduler.finish(seq)
        return request

    def pause_request(self, request_id: str) -> None:
        """Take a request out of the batches, keeping its KV blocks (its reader has fallen behind)."""
        if (request := self.requests.get(request_id)) is not None:
            request.paused = True
            for seq in request.live_sequences():
                self.scheduler.pause(seq)

    def resume_request(self, request_id: str) -> None:
        if (request := self.requests.get(request_id)) is not None:
            request.paused = False
            for seq in request.live_sequences():
                self.scheduler.resume(seq)

    def has_unfinished_requests(self) -> bool:
        """Whether a step has something to run (paused requests do not count)."""
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one forward pass; returns an output for every request that got a new token or failed (a failure
        tied to one request fails it alone, with an output whose `error` is set: engine/executor.py)."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        if self.speculator is not None:
            self.speculator.propose(batch, self.block_manager, self.config.max_num_batched_tokens)
        result = self.executor.execute(batch)
        progressed = self.output_processor.process(result, self.requests)
        num_sampled = result.num_sampled()
        if self.speculator is not None:
            self.speculator.record(result.batch, num_sampled, result.decode_cost, result.hidden)
        self.scheduler.update_from_output(result.batch, num_sampled)
        return self._outputs(progressed, result)

    def _outputs(self, progressed: list[Request], result: StepResult) -> list[RequestOutput]:
        """Each request that got tokens: its kind's after-step (forks, ends), then its output; a request that
        failed: aborted, its output carrying the error."""
        outputs = []
        for request in progressed:
            try:
                output = request.after_step(self, self.output_processor)
            except Exception as e:
                result.fail(request.request_id, "the output of", e)
                continue
            if output is not None:
                outputs.append(output)
                if output.finished:
                    del self.requests[request.request_id]
        for request_id, error in result.failed.items():
            if (request := self._drop(request_id)) is not None:
                outputs.append(
                    RequestOutput(
                        request_id,
                        request.prompt,
                        request.prompt_token_ids,
                        [],
                        finished=True,
                        error=f"{type(error).__name__}: {error}",
                    )
                )
        return outputs
