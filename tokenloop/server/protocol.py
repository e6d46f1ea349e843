"""OpenAI API request bodies (pydantic) and how their fields become SamplingParams."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from tokenloop.sampling.params import MAX_LOGPROBS, SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    # Unknown fields are ignored, as vLLM does: clients send vendor extensions freely.
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # extension (vLLM)
    min_p: float = 0.0  # extension (vLLM)
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension (vLLM)
    ignore_eos: bool = False  # extension (vLLM)
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises ValueError naming the field for values out of range."""
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0:
                raise ValueError(f"{name} is not supported yet (only 0)")
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            seed=self.seed, max_tokens=max_tokens, stop=self.stop or [], stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos, logprobs=logprobs,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and all(isinstance(t, int) for t in p)):
            return [p]
        if not p:
            raise ValueError("prompt is empty")
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def as_template_message(self) -> dict[str, Any]:
        """Text parts are joined: the models served here read text only."""
        content = self.content
        if isinstance(content, list):
            if any(part.get("type") != "text" for part in content):
                raise ValueError("messages: only text content parts are supported")
            content = "".join(str(part.get("text", "")) for part in content)
        return {**(self.model_extra or {}), "role": self.role, "content": content if content is not None else ""}


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True  # extension (vLLM)

    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def effective_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.top_logprobs}")
        return (self.top_logprobs or 0) if self.logprobs else None
