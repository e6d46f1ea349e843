"""InputProcessor: what a user sends, made into one ProcessedPrompt the engine can queue as it is.

Parsing, the chat template, tool rendering, tokenizing, compiling a grammar and every check of a prompt against
its parameters happen here, once, before anything is queued: a bad request is a ValueError naming the field, and
the engine's step never waits for any of it. Thread-safe, so that the server runs it on worker threads of its own
(engine/input_threads.py) rather than on its event loop or the step thread.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Any

from tokenloop.engine.beam_search import BeamSearchParams
from tokenloop.engine.lora import LoRARequest
from tokenloop.sampling.params import SamplingParams
from tokenloop.sampling.structured import GrammarCompiler
from tokenloop.tokenizer.tokenizer import Tokenizer, TooManyTokens
from tokenloop.tools.calling import ToolCalling

Prompt = str | list[int] | dict[str, Any]  # text, token ids, or {"prompt": ...} / {"prompt_token_ids": ...}


@dataclass(frozen=True, slots=True)
class ProcessedPrompt:
    """A prompt checked against its parameters, ready to queue (LLMEngine.add_request takes it as it is)."""

    prompt: str | None  # its text, when it came as text
    prompt_token_ids: list[int]
    params: SamplingParams | BeamSearchParams  # a SamplingParams' unset max_tokens filled in: up to the context
    lora_request: LoRARequest | None = None  # the adapter it runs (None: the base model)


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int, kv_cache_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        # A prompt fits in neither more than the context nor more than the KV cache holds.
        self.limits = ((max_model_len, "the context length"), (kv_cache_tokens, "the KV cache's size"))
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()

    def process(
        self, prompt: Prompt, params: SamplingParams | BeamSearchParams, lora_request: LoRARequest | None = None
    ) -> ProcessedPrompt:
        """Tokenize and check a prompt for `params`: a ProcessedPrompt, or ValueError before anything is queued."""
        text, token_ids = self._tokenize(prompt)
        sampling = params.sampling_params() if isinstance(params, BeamSearchParams) else params
        self.validate(token_ids, sampling)
        if isinstance(params, SamplingParams) and params.max_tokens is None:  # up to the context length
            params = replace(params, max_tokens=self.max_model_len - len(token_ids))
        return ProcessedPrompt(text, token_ids, params, lora_request)

    def chat(
        self,
        conversation: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: ToolCalling | None = None,
        continue_final_message: bool = False,
        within_limits: bool = True,
    ) -> dict[str, Any]:
        """A conversation as a prompt: the chat template's text and its token ids (special tokens parsed). Tools
        reach the template when it takes them, else the default rendering (tools/calling.py). `within_limits`: a
        conversation too long for any request is refused as it is tokenized (else process() refuses it)."""
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
        token_ids = (
            self._encode(text, add_special_tokens=False)
            if within_limits
            else self.tokenizer.encode(text, add_special_tokens=False)
        )
        return {"prompt": text, "prompt_token_ids": token_ids}

    def warm(self) -> None:
        """Build now what the first structured or long prompt would otherwise build while others stream, holding the
        GIL: llguidance's tokenizer and the tokenizer's bound on bytes per token."""
        self.grammars()
        self.tokenizer.min_tokens("")

    def grammars(self) -> GrammarCompiler:
        """llguidance's view of the tokenizer, built on first use (a fraction of a second to a second, holding the
        GIL: a server builds it as it starts)."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(
                    self.tokenizer.backend.to_str(), self.vocab_size, self.tokenizer.eos_token_ids
                )
            return self._grammars

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty")
        if params.structured_outputs is not None:
            self.grammars().grammar(params.structured_outputs)  # compiled (and cached) now: a bad spec fails here
        for name, ids in (
            ("logit_bias", params.logit_bias or {}),
            ("allowed_token_ids", params.allowed_token_ids or []),
        ):
            if bad := [t for t in ids if t >= self.vocab_size]:
                raise ValueError(f"{name} has token ids out of the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        if bad := [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]:
            raise ValueError(f"prompt token ids out of the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        if (error := self._too_long(len(token_ids))) is not None:
            raise error
        for limit, what in self.limits:  # the field to blame is max_tokens when the prompt alone leaves room
            if len(token_ids) + (params.max_tokens or 1) > limit:
                raise ValueError(
                    f"max_tokens is {params.max_tokens}: with the prompt's {len(token_ids)} tokens that makes "
                    f"{len(token_ids) + params.max_tokens}, beyond {what} of {limit} tokens"
                )
        room = self.max_model_len - len(token_ids)
        if params.max_tokens is None and params.min_tokens > room:  # (with max_tokens, SamplingParams checks)
            raise ValueError(f"min_tokens ({params.min_tokens}) must not exceed max_tokens (up to the context: {room})")

    def _too_long(self, num_tokens: int, at_least: bool = False) -> ValueError | None:
        for limit, what in self.limits:
            if num_tokens + 1 > limit:
                return ValueError(
                    f"the prompt has {'at least ' if at_least else ''}{num_tokens} tokens: no room for one more "
                    f"within {what} of {limit} tokens"
                )
        return None

    def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A text's ids. One too long for any request is refused untokenized when its bytes tell (a long text's
        tokens, even unlisted, take a tenth of a second to free, holding the GIL), else before its ids are listed."""
        if (error := self._too_long(self.tokenizer.min_tokens(text), at_least=True)) is not None:
            raise error
        try:
            return self.tokenizer.encode(text, add_special_tokens, limit=min(limit for limit, _ in self.limits) - 1)
        except TooManyTokens as e:  # beyond the smallest limit, so too long
            raise self._too_long(e.num_tokens) from None

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" not in prompt:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            return prompt, self._encode(prompt)
        if isinstance(prompt, list | tuple):
            return None, list(prompt)
        raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")
