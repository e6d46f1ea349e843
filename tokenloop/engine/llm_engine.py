"""LLMEngine: add_request / abort_request / step over a scheduler, a KV block manager and a model runner.

One step is: schedule (integers) → run the model (tensors) → process outputs (token ids back to lists, text).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any

import torch

from tokenloop.engine.block_manager import BlockManager
from tokenloop.engine.model_runner import ModelRunner, kv_bytes_per_block
from tokenloop.engine.output_processor import CompletionState, OutputProcessor, RequestState
from tokenloop.engine.scheduler import Scheduler
from tokenloop.engine.sequence import Sequence
from tokenloop.models.loader import load_model
from tokenloop.outputs import RequestOutput
from tokenloop.sampling.params import SamplingParams
from tokenloop.tokenizer.detokenizer import IncrementalDetokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

Prompt = str | list[int] | dict[str, Any]  # text, token ids, or {"prompt": ...} / {"prompt_token_ids": ...}


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # known name, .gguf file or Hugging Face folder; None = the default model
    # "auto": the fast path (4-bit GGUF weights stay 4-bit, float32 activations); "float32": every weight
    # dequantized to float32 (the exact reference path); "bfloat16", "float16".
    dtype: str = "auto"
    device: str | None = None  # None = the first accelerator torch finds, else the CPU
    block_size: int = 16  # tokens per KV cache block
    kv_cache_gb: float = 1.0  # memory for the KV block pool
    max_num_seqs: int = 64  # sequences in one step at most
    max_num_batched_tokens: int = 2048  # tokens in one step at most (decodes plus prefill chunks)
    max_model_len: int | None = None  # context length; None = the model's own
    enable_prefix_caching: bool = True
    # Decode steps run as one compiled C++ call (engine/compiled_decode.py). The first start compiles
    # (minutes on a small CPU); later starts load the package cached under $TOKENLOOP_HOME/compiled.
    compile: bool = False

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.kv_cache_gb > 0:
            raise ValueError(f"kv_cache_gb must be > 0, got {self.kv_cache_gb}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES["float32" if self.dtype == "auto" else self.dtype]

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """The fast path keeps K/V in float16, as llama.cpp does: half the memory of a long or busy cache,
        converted to float32 as attention reads it. The exact path keeps them in its own dtype."""
        return torch.float16 if self.dtype == "auto" else self.torch_dtype

    @property
    def torch_device(self) -> torch.device:
        if self.device is not None:
            return torch.device(self.device)
        accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        return accelerator if accelerator is not None else torch.device("cpu")


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        dtype, device = config.torch_dtype, config.torch_device
        loaded = load_model(config.model, dtype, device, keep_quantized=config.dtype == "auto")
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.max_model_len = min(config.max_model_len or loaded.config.max_position_embeddings, loaded.config.max_position_embeddings)
        num_blocks = int(config.kv_cache_gb * 2**30) // kv_bytes_per_block(loaded.config, config.block_size, config.kv_cache_dtype)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_gb={config.kv_cache_gb} does not hold one KV block of this model")
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(loaded.model, loaded.config, num_blocks, config.block_size, config.kv_cache_dtype, device, config.compile)
        self.output_processor = OutputProcessor(self.tokenizer, self.max_model_len)
        self.requests: dict[str, RequestState] = {}
        self._by_seq: dict[str, tuple[RequestState, CompletionState]] = {}  # running completions by sequence id
        self._ids = itertools.count()

    def tokenize_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" not in prompt:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list | tuple):
            return None, list(prompt)
        raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def process_prompt(self, prompt: Prompt, params: SamplingParams) -> dict[str, Any]:
        """Tokenize and validate a prompt: {"prompt", "prompt_token_ids"}, or ValueError before anything is queued."""
        text, token_ids = self.tokenize_prompt(prompt)
        self.validate_prompt(token_ids, params)
        return {"prompt": text, "prompt_token_ids": token_ids}

    def chat_prompt(self, conversation: list[dict[str, Any]], add_generation_prompt: bool = True) -> dict[str, Any]:
        """A conversation as a prompt: the chat template's text and its token ids (special tokens parsed)."""
        text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
        return {"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)}

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        params = params or SamplingParams()
        processed = self.process_prompt(prompt, params)
        text, token_ids = processed["prompt"], processed["prompt_token_ids"]
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.max_tokens is None:  # up to the context length
            params = replace(params, max_tokens=self.max_model_len - len(token_ids))
        request = RequestState(request_id, text, token_ids, params)
        self.requests[request_id] = request
        # The other n - 1 completions join once this one has prefilled the prompt: they then find its
        # full blocks in the prefix cache and share them instead of computing them again.
        self.scheduler.add(self._new_completion(request))
        return request_id

    def _new_completion(self, request: RequestState) -> Sequence:
        index = len(request.completions)
        params = request.params
        generator = None
        if params.seed is not None:  # completion i of a seeded request uses seed + i, as vLLM does
            generator = torch.Generator(self.config.torch_device).manual_seed(params.seed + index)
        seq = Sequence(f"{request.request_id}/{index}", list(request.prompt_token_ids), len(request.prompt_token_ids), params, generator)
        detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params.stop, params.skip_special_tokens)
        request.completions.append(CompletionState(index, seq, detokenizer))
        self._by_seq[seq.seq_id] = (request, request.completions[-1])
        return seq

    def validate_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if bad := [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]:
            raise ValueError(f"prompt token ids out of the vocabulary [0, {vocab}): {bad[:5]}")
        wanted = len(token_ids) + (params.max_tokens or 1)
        if wanted > self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens and max_tokens is {params.max_tokens}: "
                f"{wanted} tokens exceed the context length of {self.max_model_len}"
            )
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        if wanted > capacity:
            raise ValueError(f"{wanted} tokens (prompt plus max_tokens) exceed the KV cache's {capacity} tokens")

    def abort_request(self, request_id: str) -> None:
        """Drop a request and free its KV blocks at once; unknown or finished ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for completion in request.completions:
            self._by_seq.pop(completion.seq.seq_id, None)
            if not completion.finished:
                self.scheduler.finish(completion.seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one forward pass; returns an output for every request that got a new token."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        sampled_indices, samples = self.runner.execute(batch)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            self.block_manager.cache_full_blocks(seq)
        progressed: dict[str, RequestState] = {}
        for row, index in enumerate(sampled_indices):
            request, completion = self._by_seq[batch.seqs[index].seq_id]
            self.output_processor.append(completion, samples, row)
            if completion.finished:
                self.scheduler.finish(completion.seq)
                del self._by_seq[completion.seq.seq_id]
            if completion.index == 0 and len(request.completions) == 1:
                for _ in range(request.params.n - 1):
                    self.scheduler.add(self._new_completion(request))
            progressed[request.request_id] = request
        outputs = [self.output_processor.make_output(request) for request in progressed.values()]
        for out in outputs:
            if out.finished:
                del self.requests[out.request_id]
        return outputs
