"""LLM: the offline API, shaped like vLLM's (`LLM(...).generate(prompts, SamplingParams(...))`, `.chat(...)`)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace

from tqdm import tqdm

from tokenloop.engine.beam_search import BeamSearchParams
from tokenloop.engine.config import EngineConfig
from tokenloop.engine.input_processor import Prompt
from tokenloop.engine.llm_engine import LLMEngine
from tokenloop.engine.lora import LoRARequest
from tokenloop.outputs import RequestOutput
from tokenloop.sampling.params import SamplingParams
from tokenloop.strategies import skeleton
from tokenloop.strategies.self_consistency import AnswerSpec, Vote, VoteCounter
from tokenloop.strategies.skeleton import Skeleton
from tokenloop.tokenizer.tokenizer import Tokenizer
from tokenloop.tools.calling import Function, ToolCalling

Conversation = list[dict[str, str]]


class LLM:
    def __init__(self, model: str | os.PathLike | None = None, **engine_args) -> None:
        """`model`: a known name (default smollm2-135m-instruct), a .gguf file or a Hugging Face folder.
        Other keyword arguments are EngineConfig fields (dtype, device, kv_cache_gb, ...)."""
        self.llm_engine = LLMEngine(EngineConfig(model=None if model is None else os.fspath(model), **engine_args))

    def get_tokenizer(self) -> Tokenizer:
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the prompts' order. `lora_request`: the adapter every
        prompt runs, or one per prompt (None: the base model); the LLM needs enable_lora=True."""
        is_batch = isinstance(prompts, list | tuple) and not (prompts and isinstance(prompts[0], int))
        prompts = list(prompts) if is_batch else [prompts]  # a single prompt may itself be a list of token ids
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_request = [lora_request] * len(prompts)
        if len(lora_request) != len(prompts):
            raise ValueError(f"got {len(lora_request)} LoRA requests for {len(prompts)} prompts")
        engine = self.llm_engine
        # Tokenize and validate every prompt before any runs, so a bad one does not leave the others half-done.
        inputs = [engine.input_processor.process(*args) for args in zip(prompts, sampling_params, lora_request)]
        ids = [engine.add_request(p) for p in inputs]
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Step the engine until every request of `ids` has finished; their outputs in that order."""
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generating", disable=not use_tqdm or len(ids) < 2) as bar:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        if failed := [out for out in finished.values() if out.error]:
            raise RuntimeError(f"{len(failed)} of {len(ids)} requests failed; the first: {failed[0].error}")
        return [finished[i] for i in ids]

    def beam_search(
        self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams, use_tqdm: bool = True
    ) -> list[RequestOutput]:
        """Beam search per prompt (transformers' semantics, engine/beam_search.py); each output's completions are
        its best params.n beams, best first. The beams of every prompt run in the same steps."""
        is_batch = isinstance(prompts, list | tuple) and not (prompts and isinstance(prompts[0], int))
        prompts = list(prompts) if is_batch else [prompts]
        engine = self.llm_engine
        inputs = [engine.input_processor.process(p, params) for p in prompts]  # every prompt checked before any runs
        return self._run([engine.add_request(p) for p in inputs], use_tqdm)

    def self_consistency(
        self, prompt: Prompt, n: int, answer: str | dict | AnswerSpec, params: SamplingParams | None = None
    ) -> Vote:
        """Sample n continuations of `prompt` (forked off one prefill) and vote on their answers: `answer` is a
        regex with one group, or a JSON schema with an "answer" property (the samples then follow it). The
        samples still running are aborted once no answer can overtake the leader."""
        spec = AnswerSpec.of(answer)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an integer >= 1, got {n!r}")
        engine = self.llm_engine
        request_id = engine.add_request(
            prompt, spec.params(params or SamplingParams(temperature=0.8, max_tokens=256), n)
        )
        counter = VoteCounter(spec, n)
        while engine.has_unfinished_requests():
            outs = [out for out in engine.step() if out.request_id == request_id]
            if outs and (outs[-1].error or counter.update(outs[-1])):
                if outs[-1].error:
                    raise RuntimeError(f"the request failed: {outs[-1].error}")
                engine.abort_request(request_id)
                break
        return counter.result()

    def skeleton_of_thought(
        self, question: str, params: SamplingParams | None = None, together: bool = True
    ) -> Skeleton:
        """Outline first (3-5 points, a grammar), then every point expanded by a sequence forked off the outline's
        (its question-and-outline blocks shared), all in the same steps; `together=False` expands them one after
        another instead (the same prompts: what the benchmark compares against)."""
        params = params or SamplingParams(temperature=0, max_tokens=96)
        engine = self.llm_engine
        prompt = self.chat_prompt(skeleton.outline_conversation(question))
        outline_id = engine.add_request(prompt, skeleton.outline_params(params), retain=True)
        try:
            outline = self._run([outline_id], use_tqdm=False)[0].outputs[0]
            points = skeleton.points_of(outline.text)
            conversations = skeleton.expansion_conversations(question, outline.text, points)
            suffixes = skeleton.expansion_suffixes(
                self.get_tokenizer(), prompt["prompt"], outline.token_ids, conversations
            )
            expansion = replace(params, n=1)
            if together:
                outs = self._run(engine.fork_request(outline_id, suffixes, expansion), use_tqdm=False)
            else:
                outs = [
                    self._run(engine.fork_request(outline_id, [suffix], expansion), use_tqdm=False)[0]
                    for suffix in suffixes
                ]
        finally:
            engine.release_request(outline_id)
        return skeleton.assemble(points, [out.outputs[0].text for out in outs])

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate. `tools` (OpenAI's
        {"type": "function", "function": {...}} entries) reach the template, or the default rendering
        (tools/calling.py); constraining the reply to calls is the server's tool_choice."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.chat_prompt(c, add_generation_prompt, continue_final_message, tools) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def chat_prompt(
        self,
        conversation: Conversation,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
    ) -> dict:
        """A conversation as a prompt: the template's text and its token ids (special tokens parsed)."""
        calling = None
        if tools:
            calling = ToolCalling([Function.from_openai(t["function"]) for t in tools], "none")
        return self.llm_engine.input_processor.chat(
            conversation, add_generation_prompt, calling, continue_final_message, within_limits=False
        )
