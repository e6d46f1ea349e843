"""LLMEngine: add_request / abort_request / step over a scheduler, a KV block manager and a model runner.

One step is: schedule (integers) → run the model (tensors) → process outputs (token ids back to lists, text).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from tokenloop import kernels
from tokenloop.engine.beam_search import Beam, BeamSearch, BeamSearchParams
from tokenloop.engine.block_manager import BlockManager, weights_fingerprint
from tokenloop.engine.compiled_decode import CompileSpec
from tokenloop.engine.faults import FaultInjection, InjectedFault
from tokenloop.engine.model_runner import ModelInput, ModelRunner, PromptScores, StepSamples, kv_bytes_per_block
from tokenloop.engine.output_processor import CompletionState, OutputProcessor, RequestState
from tokenloop.engine.scheduler import ScheduledBatch, Scheduler
from tokenloop.engine.sequence import Sequence
from tokenloop.engine.threads import default_threads
from tokenloop.models.loader import load_model
from tokenloop.outputs import CompletionOutput, RequestOutput
from tokenloop.sampling.params import SamplingParams
from tokenloop.sampling.processors import LogitControls
from tokenloop.sampling.structured import GrammarCompiler
from tokenloop.spec_decode.config import SpeculativeConfig
from tokenloop.spec_decode.draft_model import DraftModelProposer
from tokenloop.spec_decode.ngram import NgramProposer
from tokenloop.spec_decode.speculator import Speculator
from tokenloop.tokenizer.detokenizer import IncrementalDetokenizer
from tokenloop.tools.calling import ToolCalling

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

Prompt = str | list[int] | dict[str, Any]  # text, token ids, or {"prompt": ...} / {"prompt_token_ids": ...}
logger = logging.getLogger(__name__)


def _check_device(device: str) -> None:
    try:
        kind = torch.device(device).type
    except RuntimeError as e:
        raise ValueError(f"device {device!r} is not a torch device: {e}") from None
    if kind != "cpu" and not (
        torch.accelerator.is_available() and torch.accelerator.current_accelerator().type == kind
    ):
        build = (
            "a CPU-only build"
            if torch.version.cuda is None and torch.version.hip is None
            else f"built for {torch.version.cuda or torch.version.hip}"
        )
        raise ValueError(
            f"device {device!r} is not available: this torch {torch.__version__} is {build} (see the README on GPUs)"
        )


def compile_by_default() -> bool:
    """Decode steps are compiled unless TOKENLOOP_COMPILE=0 says otherwise."""
    return os.environ.get("TOKENLOOP_COMPILE", "1") != "0"


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
    # Decode steps run as one compiled C++ call (engine/compiled_decode.py), cached under $TOKENLOOP_HOME/compiled.
    # A start without the package runs eager while a child process compiles it (compile_in_background), or
    # compiles it first. TOKENLOOP_COMPILE=0 in the environment turns the default off.
    compile: bool = field(default_factory=compile_by_default)
    compile_in_background: bool = True
    threads: int | None = (
        None  # CPU threads for the step (torch.set_num_threads); None = one per idle core (engine/threads.py)
    )
    inject_faults: tuple[str, ...] = ()  # tests only: "STAGE:TOKEN_ID" each (engine/faults.py)
    # Speculative decoding (spec_decode/): {"method": "ngram" | "draft", "num_speculative_tokens": k, ...}; None = off.
    speculative_config: SpeculativeConfig | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.block_size % 16:  # attention reads keys 16 consecutive positions at a time
            raise ValueError(f"block_size must be a multiple of 16, got {self.block_size}")
        if not self.kv_cache_gb > 0:
            raise ValueError(f"kv_cache_gb must be > 0, got {self.kv_cache_gb}")
        if self.device is not None:
            _check_device(self.device)
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise ValueError(f"threads must be an integer >= 1, got {self.threads!r}")
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.of(self.speculative_config)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES["float32" if self.dtype == "auto" else self.dtype]

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """The fast path keeps K/V in 16 bits, as llama.cpp does (half the memory of a long or busy cache):
        bfloat16 where the CPU multiplies bfloat16 pairs (AVX512-BF16), which attention's products then read as
        they are, else float16, converted to float32 as attention reads it. The exact path keeps its own dtype."""
        if self.dtype != "auto":
            return self.torch_dtype
        return (
            torch.bfloat16 if self.torch_device.type == "cpu" and kernels.bfloat16_cache_supported() else torch.float16
        )

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
        threads = config.threads if config.threads is not None else default_threads()
        if threads != torch.get_num_threads():
            if config.threads is None:
                logger.info(
                    "using %d CPU thread(s): other processes keep the other cores busy (--threads sets it)", threads
                )
            torch.set_num_threads(threads)
        loaded = load_model(config.model, dtype, device, keep_quantized=config.dtype == "auto")
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.max_model_len = min(
            config.max_model_len or loaded.config.max_position_embeddings, loaded.config.max_position_embeddings
        )
        num_blocks = int(config.kv_cache_gb * 2**30) // kv_bytes_per_block(
            loaded.config, config.block_size, config.kv_cache_dtype
        )
        if num_blocks < 1:
            raise ValueError(f"kv_cache_gb={config.kv_cache_gb} does not hold one KV block of this model")
        # Blocks' K/V depend on the weights, on their precision ("auto" keeps them quantized) and on the cache's dtype.
        identity = f"{weights_fingerprint(loaded.path)} dtype={config.dtype} kv={config.kv_cache_dtype}"
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching, identity)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(
            loaded.model,
            loaded.config,
            num_blocks,
            config.block_size,
            config.kv_cache_dtype,
            device,
            config.compile,
            self._compile_spec(config)(loaded.path) if config.compile and config.compile_in_background else None,
        )
        self.speculator = self._speculator(config, num_blocks) if config.speculative_config is not None else None
        # While the background compile runs it takes a core: a step on every core would wait for the one it shares
        # (SmolLM2's eager decode on 2 cores fell from 102 to 39 tokens/s; on one thread it kept 93).
        self._threads_after_compile: int | None = None
        if self.runner.forward.worker is not None and config.threads is None and threads > 1:
            self._threads_after_compile = threads
            torch.set_num_threads(threads - 1)
        self.output_processor = OutputProcessor(
            self.tokenizer, self.max_model_len, speculative=self.speculator is not None
        )
        self.requests: dict[str, RequestState] = {}
        self._by_seq: dict[str, tuple[RequestState, CompletionState]] = {}  # running completions by sequence id
        self._ids = itertools.count()
        self.faults = [FaultInjection.parse(spec) for spec in config.inject_faults]
        self._grammars: GrammarCompiler | None = None
        self._retained: dict[str, Sequence] = {}  # finished requests' sequences that keep their blocks (retain=True)

    @staticmethod
    def _compile_spec(config: EngineConfig):
        """How a background compile loads a model of this config: model path -> CompileSpec."""
        return lambda path: CompileSpec(
            str(path),
            str(config.torch_dtype).removeprefix("torch."),
            str(config.torch_device),
            config.dtype == "auto",
            str(config.kv_cache_dtype).removeprefix("torch."),
            config.block_size,
        )

    def _speculator(self, config: EngineConfig, num_blocks: int) -> Speculator:
        spec = config.speculative_config
        if spec.method == "ngram":
            proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        else:  # the draft model's own config: its dtype, the target's device, cache blocks and compile setting
            draft = EngineConfig(
                model=spec.model or config.model,
                dtype=spec.dtype,
                device=config.device,
                block_size=config.block_size,
                compile=config.compile,
                compile_in_background=config.compile_in_background,
            )
            proposer = DraftModelProposer.load(
                draft.model,
                draft.torch_dtype,
                draft.kv_cache_dtype,
                draft.dtype == "auto",
                draft.torch_device,
                self.model_config.vocab_size,
                num_blocks,
                config.block_size,
                draft.compile,
                self._compile_spec(draft) if draft.compile and draft.compile_in_background else None,
            )
        return Speculator(spec, proposer, self.max_model_len, set(self.tokenizer.eos_token_ids))

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

    def process_prompt(self, prompt: Prompt, params: SamplingParams | BeamSearchParams) -> dict[str, Any]:
        """Tokenize and validate a prompt: {"prompt", "prompt_token_ids"}, or ValueError before anything is queued."""
        if isinstance(params, BeamSearchParams):
            params = params.sampling_params()
        text, token_ids = self.tokenize_prompt(prompt)
        self.validate_prompt(token_ids, params)
        return {"prompt": text, "prompt_token_ids": token_ids}

    def chat_prompt(
        self,
        conversation: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: ToolCalling | None = None,
        continue_final_message: bool = False,
    ) -> dict[str, Any]:
        """A conversation as a prompt: the chat template's text and its token ids (special tokens parsed). Tools
        reach the template when it takes them, else the default rendering (tools/calling.py)."""
        kwargs: dict[str, Any] = {}
        if tools is not None:
            conversation, kwargs = tools.render(
                conversation, template_takes_tools="tools" in (self.tokenizer.chat_template or "")
            )
        text = self.tokenizer.apply_chat_template(
            conversation,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **kwargs,
        )
        return {"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)}

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | BeamSearchParams | None = None,
        request_id: str | None = None,
        retain: bool = False,
    ) -> str:
        """Queue a request. `retain` (n = 1): once it finishes, its sequence keeps its KV blocks, for
        fork_request to continue it, until release_request."""
        if isinstance(params, BeamSearchParams):
            return self.add_beam_request(prompt, params, request_id)
        params = params or SamplingParams()
        if retain and params.n != 1:
            raise ValueError(f"n must be 1 for a retained request, got {params.n}")
        processed = self.process_prompt(prompt, params)
        text, token_ids = processed["prompt"], processed["prompt_token_ids"]
        request_id = self._request_id(request_id)
        if params.max_tokens is None:  # up to the context length
            params = replace(params, max_tokens=self.max_model_len - len(token_ids))
        request = RequestState(
            request_id,
            text,
            token_ids,
            params,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            retain=retain,
        )
        self.requests[request_id] = request
        # The other n - 1 completions fork off this one once it has prefilled the prompt (_update).
        self._add_completion(request)
        return request_id

    def _request_id(self, request_id: str | None) -> str:
        """The caller's id, checked to be free, or a new one."""
        if request_id is None:
            return str(next(self._ids))
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        return request_id

    def _new_completion(self, request: RequestState) -> Sequence:
        index = len(request.completions)
        params = request.params
        generator = None
        if params.seed is not None:  # completion i of a seeded request uses seed + i, as vLLM does
            generator = torch.Generator(self.config.torch_device).manual_seed(params.seed + index)
        seq = Sequence(
            f"{request.request_id}/{index}",
            list(request.prompt_token_ids),
            len(request.prompt_token_ids),
            params,
            generator,
        )
        seq.score_prompt = index == 0 and params.prompt_logprobs is not None  # the others share its prompt
        seq.controls = LogitControls.for_request(
            params,
            seq.num_prompt_tokens,
            lambda text: self.tokenizer.encode(text, add_special_tokens=False),
            self.tokenizer.eos_token_ids,
            self.grammars() if params.structured_outputs is not None else None,
        )
        detokenizer = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, params.stop, params.skip_special_tokens
        )
        request.completions.append(CompletionState(index, seq, detokenizer))
        self._by_seq[seq.seq_id] = (request, request.completions[-1])
        return seq

    def grammars(self) -> GrammarCompiler:
        """llguidance's view of this engine's tokenizer, built on the first structured request (about a second)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(
                self.tokenizer.backend.to_str(), self.model_config.vocab_size, self.tokenizer.eos_token_ids
            )
        return self._grammars

    def validate_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty")
        if params.structured_outputs is not None:
            self.grammars().grammar(
                params.structured_outputs
            )  # compiled (and cached) now: a bad spec is a ValueError here
        vocab = self.model_config.vocab_size
        for name, ids in (
            ("logit_bias", params.logit_bias or {}),
            ("allowed_token_ids", params.allowed_token_ids or []),
        ):
            if bad := [t for t in ids if t >= vocab]:
                raise ValueError(f"{name} has token ids out of the vocabulary [0, {vocab}): {bad[:5]}")
        if bad := [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]:
            raise ValueError(f"prompt token ids out of the vocabulary [0, {vocab}): {bad[:5]}")
        # The field to blame is max_tokens when the prompt alone leaves room for a token.
        for limit, what in (
            (self.max_model_len, "the context length"),
            (self.block_manager.num_blocks * self.block_manager.block_size, "the KV cache's size"),
        ):
            if len(token_ids) + 1 > limit:
                raise ValueError(
                    f"the prompt has {len(token_ids)} tokens: no room for one more within {what} of {limit} tokens"
                )
            if len(token_ids) + (params.max_tokens or 1) > limit:
                raise ValueError(
                    f"max_tokens is {params.max_tokens}: with the prompt's {len(token_ids)} tokens that makes "
                    f"{len(token_ids) + params.max_tokens}, beyond {what} of {limit} tokens"
                )
        if params.max_tokens is None and params.min_tokens > self.max_model_len - len(
            token_ids
        ):  # (with max_tokens, SamplingParams checks)
            raise ValueError(
                f"min_tokens ({params.min_tokens}) must not exceed max_tokens "
                f"(up to the context: {self.max_model_len - len(token_ids)})"
            )

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Drop a request and free its KV blocks at once; returns its last output, every unfinished completion
        ending with finish_reason "abort" (None for unknown or finished ids)."""
        request = self._drop(request_id)
        return None if request is None else self.output_processor.make_output(request, finished=True)

    def _drop(self, request_id: str) -> RequestState | None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for completion in request.completions:
            self._by_seq.pop(completion.seq.seq_id, None)
            if not completion.finished:
                completion.seq.finish_reason = "abort"
                self._finish(completion.seq)
        for beam in request.beam.beams if request.beam is not None else []:
            self._by_seq.pop(beam.seq.seq_id, None)
            self._finish(beam.seq)
        return request

    def pause_request(self, request_id: str) -> None:
        """Take a request out of the batches, keeping its KV blocks (its reader has fallen behind)."""
        if (request := self.requests.get(request_id)) is not None:
            request.paused = True
            for completion in request.completions:
                self.scheduler.pause(completion.seq)

    def resume_request(self, request_id: str) -> None:
        if (request := self.requests.get(request_id)) is not None:
            request.paused = False
            for completion in request.completions:
                self.scheduler.resume(completion.seq)

    def has_unfinished_requests(self) -> bool:
        """Whether a step has something to run (paused requests do not count)."""
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one forward pass; returns an output for every request that got a new token or failed.

        A failure tied to one request (preparing its rows, sampling its row, detokenizing its tokens) fails
        that request alone, with an output whose `error` is set; the step goes on for the others. Only a
        failed forward pass, which no single request can be blamed for, fails every request of the batch.
        """
        if self._threads_after_compile is not None and self.runner.forward.worker is None:  # the compile has ended
            torch.set_num_threads(self._threads_after_compile)
            self._threads_after_compile = None
        batch = self.scheduler.schedule()
        if not batch:
            return []
        if self.speculator is not None:
            self._speculate(batch)
        failed: dict[str, Exception] = {}  # request id -> what failed it
        inp, batch = self._prepare(batch, failed)
        started = time.perf_counter()
        samples, scores = self._run(inp, batch, failed) if batch else (None, [])
        if self.speculator is not None and inp is not None and inp.decode_only and not failed:
            self.speculator.observe_step(len(inp.input_ids), time.perf_counter() - started)
        outputs = self._update(batch, inp, samples, scores, failed)
        return outputs + [self._fail(request_id, e) for request_id, e in failed.items() if request_id in self.requests]

    def _speculate(self, batch: ScheduledBatch) -> None:
        """Drafts for the batch's sampling sequences. Should the proposer fail, the step runs without them."""
        planned = list(batch.num_new_tokens)
        try:
            self.speculator.plan(batch, self.block_manager, self.config.max_num_batched_tokens)
        except Exception:
            logger.exception("proposing draft tokens failed: this step runs without them")
            for seq in batch.seqs:
                seq.draft = None
            batch.num_new_tokens[:] = planned

    def _request_of(self, seq: Sequence) -> str:
        return self._by_seq[seq.seq_id][0].request_id

    def _inject(self, stage: str, seqs: list[Sequence]) -> None:
        for fault in self.faults:
            for seq in seqs:
                fault.check(stage, seq)

    def _failed(self, failed: dict[str, Exception], request_id: str, stage: str, e: Exception) -> None:
        """Record (and log, with the traceback unless a test injected it) that a request failed."""
        logger.error("%s request %s failed: %s", stage, request_id, e, exc_info=not isinstance(e, InjectedFault))
        failed.setdefault(request_id, e)

    def _prepare(self, batch: ScheduledBatch, failed: dict[str, Exception]) -> tuple[ModelInput | None, ScheduledBatch]:
        """The step's tensors. If building them fails, each sequence is tried alone: the ones that fail are
        dropped from the step, the others run."""
        try:
            self._inject("stall", batch.seqs)
            self._inject("die", batch.seqs)
            self._inject("prepare", batch.seqs)
            return self.runner.prepare(batch), batch
        except Exception:
            pass
        kept = ScheduledBatch([], [], batch.block_copies)  # the copies are owed whoever fails
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            try:
                self._inject("prepare", [seq])
                self.runner.prepare(ScheduledBatch([seq], [n]))
            except Exception as e:
                self._failed(failed, self._request_of(seq), "preparing", e)
                continue
            kept.seqs.append(seq)
            kept.num_new_tokens.append(n)
        return (self.runner.prepare(kept) if kept else None), kept

    def _run(
        self, inp: ModelInput, batch: ScheduledBatch, failed: dict[str, Exception]
    ) -> tuple[StepSamples | None, list[PromptScores]]:
        """The forward pass, then sampling and prompt scoring. A failed forward pass fails every request of the
        batch (none can be blamed); a failed sampling is retried row by row, so that only the rows that fail are
        lost."""
        try:
            logits = self.runner.logits(inp)
        except Exception as e:
            logger.exception("the forward pass failed: failing the %d requests of its batch", len(batch))
            for seq in batch.seqs:
                failed.setdefault(self._request_of(seq), e)
            return None, []
        if logits is None:
            return None, []
        scores = []
        if any(span.num_scored for span in inp.spans):
            try:
                scores = self.runner.score(logits, inp, batch.seqs)
            except Exception as e:
                for span in inp.spans:
                    if span.num_scored:
                        self._failed(failed, self._request_of(batch.seqs[span.seq_index]), "scoring", e)
        if not inp.sample_spans:
            return None, scores
        logits = self.runner.sample_logits(logits, inp)
        seqs = [batch.seqs[i] for i in inp.sample_seq_indices]
        try:
            self._inject("sample", seqs)
            return self.runner.sample(logits, seqs), scores
        except Exception:
            pass
        parts, row = [], 0
        for span, seq in zip(inp.sample_spans, seqs):
            rows = slice(row, row + span.num_sampling_rows)
            row = rows.stop
            try:
                self._inject("sample", [seq])
                parts.append(self.runner.sample(logits[rows], [seq]))
            except Exception as e:
                self._failed(failed, self._request_of(seq), "sampling", e)
                parts.append(StepSamples([-1], None, None, None, [1]))  # a placeholder row, never read
        return StepSamples.concat(parts), scores

    def _update(
        self,
        batch: ScheduledBatch,
        inp: ModelInput | None,
        samples: StepSamples | None,
        scores: list[PromptScores],
        failed: dict[str, Exception],
    ) -> list[RequestOutput]:
        """The post-step update, for the requests that did not fail, in this order: store prompt logprobs; append each
        sampling sequence's new tokens (a verified draft's accepted tokens and one more; a beam's row waits for its
        siblings'); step num_computed_tokens on (rejected draft tokens' slots are abandoned and the blocks past the
        sequence's tokens freed); register full blocks in the prefix cache, so that only computed, accepted tokens
        ever reach it (and never a failed request's: its K/V may be wrong); then fork, finish, and build outputs."""
        for score in scores:
            seq = batch.seqs[score.seq_index]
            request, _ = self._by_seq[seq.seq_id]
            if request.request_id not in failed:
                self.output_processor.append_prompt_logprobs(request, seq, score)
        new_tokens: dict[int, int] = {}  # batch index -> tokens its sequence got this step
        appended: list[tuple[RequestState, CompletionState]] = []
        beams: dict[str, RequestState] = {}
        for index, rows in zip(
            inp.sample_seq_indices if samples is not None else [], samples.rows_of() if samples is not None else []
        ):
            seq = batch.seqs[index]
            request, completion = self._by_seq[seq.seq_id]
            if request.request_id in failed:
                continue
            new_tokens[index] = len(rows)
            if request.beam is not None:  # a beam: its row's best tokens wait for the other beams' rows
                request.beam.add_row(seq, samples.logprob_token_ids[rows[0]][1:], samples.logprobs[rows[0]][1:])
                beams[request.request_id] = request
                continue
            try:
                self._inject("detokenize", [seq])
                for row in rows:  # a stop among a draft's accepted tokens drops the ones after it
                    self.output_processor.append(completion, samples, row)
                    if completion.finished:
                        break
            except Exception as e:
                self._failed(failed, request.request_id, "updating", e)
                continue
            appended.append((request, completion))
        for index, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            if self._request_of(seq) in failed:
                seq.draft = None
                continue
            if seq.draft is not None:
                rejected = self.speculator.record(seq, new_tokens[index])
                seq.num_computed_tokens = min(seq.num_computed_tokens + n - rejected, seq.num_tokens - 1)
                self.block_manager.trim(seq)
            else:
                seq.num_computed_tokens += n
            self.block_manager.cache_full_blocks(seq)
        progressed: dict[str, RequestState] = {}
        for request, completion in appended:
            if request.request_id in failed:
                continue
            try:
                if completion.index == 0 and len(request.completions) == 1:
                    # The other n - 1 completions fork off this one once it has prefilled the prompt: they share
                    # its KV blocks and compute only the prompt's last token again, to sample their own first.
                    for _ in range(request.params.n - 1):
                        self._fork_completion(request, completion.seq)
                if completion.finished:
                    if request.retain:  # its blocks stay for fork_request, until release_request
                        self._finish(completion.seq, free=False)
                        self._retained[request.request_id] = completion.seq
                    else:
                        self._finish(completion.seq)
                    del self._by_seq[completion.seq.seq_id]
            except Exception as e:
                self._failed(failed, request.request_id, "updating", e)
                continue
            progressed[request.request_id] = request
        outputs = []
        for request in beams.values():
            if request.request_id not in failed and request.beam.ready:
                try:
                    if (output := self._advance_beams(request)) is not None:
                        outputs.append(output)
                except Exception as e:
                    self._failed(failed, request.request_id, "the beams of", e)
        for request in progressed.values():
            if request.request_id in failed:
                continue
            try:
                outputs.append(self.output_processor.make_output(request))
            except Exception as e:
                self._failed(failed, request.request_id, "the output of", e)
                continue
            if outputs[-1].finished:
                del self.requests[request.request_id]
        return outputs

    def _finish(self, seq: Sequence, free: bool = True) -> None:
        """A sequence is done (finished, aborted or failed): out of the scheduler, and of the proposer's state."""
        self.scheduler.finish(seq, free)
        if self.speculator is not None:
            self.speculator.release(seq)

    def _add_completion(self, request: RequestState) -> None:
        seq = self._new_completion(request)
        self.scheduler.add(seq)
        if request.paused:
            self.scheduler.pause(seq)

    def fork_request(self, request_id: str, suffixes: list[list[int]], params: SamplingParams) -> list[str]:
        """New requests that continue a finished, retained one: each prompt is its tokens (prompt and output)
        followed by a suffix, and starts on its KV blocks, by reference; only the suffix is computed."""
        parent = self._retained.get(request_id)
        if parent is None:
            raise ValueError(f"request {request_id!r} is not a finished request kept with retain=True")
        ids = []
        for suffix in suffixes:
            token_ids = parent.token_ids + list(suffix)
            self.validate_prompt(token_ids, params)
            child_id = self._request_id(None)
            params_of_child = replace(params, max_tokens=params.max_tokens or self.max_model_len - len(token_ids))
            request = RequestState(child_id, None, token_ids, params_of_child)
            self.requests[child_id] = request
            seq = self._new_completion(request)
            self.scheduler.fork(parent, seq, parent.num_computed_tokens)
            ids.append(child_id)
        return ids

    def release_request(self, request_id: str) -> None:
        """Free the blocks a finished, retained request kept."""
        if (seq := self._retained.pop(request_id, None)) is not None:
            self.block_manager.free(seq)

    def _fork_completion(self, request: RequestState, parent: Sequence) -> None:
        seq = self._new_completion(request)
        self.scheduler.fork(parent, seq, seq.num_prompt_tokens - 1)
        if request.paused:
            self.scheduler.pause(seq)

    def add_beam_request(self, prompt: Prompt, params: BeamSearchParams, request_id: str | None = None) -> str:
        """A beam search (engine/beam_search.py): its beams are sequences run in the same steps as the other
        requests; its one output, at the end, holds the best params.n beams, best first."""
        sampling = params.sampling_params()
        processed = self.process_prompt(prompt, sampling)
        request_id = self._request_id(request_id)
        token_ids = processed["prompt_token_ids"]
        request = RequestState(request_id, processed["prompt"], token_ids, sampling)
        request.beam = BeamSearch(params, frozenset(self.tokenizer.eos_token_ids), [])
        seq = self._new_beam(request, Sequence(f"{request_id}/0", list(token_ids), len(token_ids), sampling))
        request.beam.beams = [Beam(seq, 0.0)]
        self.requests[request_id] = request
        self.scheduler.add(seq)
        return request_id

    def _new_beam(self, request: RequestState, seq: Sequence) -> Sequence:
        seq.num_candidates = request.beam.num_candidates
        self._by_seq[seq.seq_id] = (request, None)
        return seq

    def _advance_beams(self, request: RequestState) -> RequestOutput | None:
        """One step of a beam search whose live beams all have their rows: fork the continuations off their
        parents (first the forks, while the parents still hold only their own tokens; then each gets its token),
        end the beams nobody continues, and at the end return the output."""
        search = request.beam
        continuations = search.advance()
        taken: set[str] = set()
        seqs = []
        for c in continuations:
            parent = c.parent.seq
            if parent.seq_id in taken:
                child = Sequence(
                    f"{request.request_id}/{next(search.beam_ids)}",
                    list(parent.token_ids),
                    parent.num_prompt_tokens,
                    parent.params,
                )
                self.scheduler.fork(parent, self._new_beam(request, child), parent.num_computed_tokens)
                seqs.append(child)
            else:
                taken.add(parent.seq_id)
                seqs.append(parent)
        for beam in search.beams:
            if beam.seq.seq_id not in taken:
                self._finish(beam.seq)
                del self._by_seq[beam.seq.seq_id]
        for seq, c in zip(seqs, continuations):
            seq.token_ids.append(c.token_id)
        search.beams = [Beam(seq, c.logprob) for seq, c in zip(seqs, continuations)]
        if not search.done:
            return None
        del self.requests[request.request_id]
        completions = [
            CompletionOutput(
                i,
                self.tokenizer.decode(h.token_ids, skip_special_tokens=True),
                h.token_ids,
                h.logprob,
                None,
                "stop" if h.ended_by_eos else "length",
                None,
            )
            for i, h in enumerate(search.best())
        ]
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions, finished=True)

    def _fail(self, request_id: str, error: Exception) -> RequestOutput:
        """Abort a request that failed; its output carries the error."""
        request = self._drop(request_id)
        message = f"{type(error).__name__}: {error}"
        return RequestOutput(request_id, request.prompt, request.prompt_token_ids, [], finished=True, error=message)
