"""OpenAI response bodies built from RequestOutputs: choices, logprobs, usage, stream chunks."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenloop.outputs import CompletionOutput, Logprob, RequestOutput


@dataclass(slots=True)
class ChoiceProgress:
    """What a stream has already sent of one choice."""

    text_len: int = 0
    logprobs_len: int = 0
    started: bool = False
    finished: bool = False  # its finish_reason has been sent


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def add(self, out: RequestOutput) -> None:
        self.prompt_tokens += len(out.prompt_token_ids)
        self.completion_tokens += sum(len(c.token_ids) for c in out.outputs)
        self.cached_tokens += out.num_cached_tokens

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


def _top(entries: dict[int, Logprob], k: int) -> list[Logprob]:
    return sorted((lp for lp in entries.values() if lp.rank is not None and lp.rank <= k), key=lambda lp: lp.rank)


def completion_logprobs(c: CompletionOutput, start: int, k: int, text_offset: int) -> dict:
    """The legacy completions format, for c's tokens from `start` on; offsets count from `text_offset`."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, entries in zip(c.token_ids[start:], (c.logprobs or [])[start:]):
        chosen = entries[token_id]
        tokens.append(chosen.decoded_token)
        token_logprobs.append(chosen.logprob)
        top_logprobs.append({lp.decoded_token: lp.logprob for lp in _top(entries, k)} | {chosen.decoded_token: chosen.logprob})
        offsets.append(text_offset)
        text_offset += len(chosen.decoded_token or "")
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def chat_logprobs(c: CompletionOutput, start: int, k: int) -> dict:
    def entry(lp: Logprob) -> dict:
        token = lp.decoded_token or ""
        return {"token": token, "logprob": lp.logprob, "bytes": list(token.encode("utf-8"))}

    content = []
    for token_id, entries in zip(c.token_ids[start:], (c.logprobs or [])[start:]):
        content.append(entry(entries[token_id]) | {"top_logprobs": [entry(lp) for lp in _top(entries, k)]})
    return {"content": content}


@dataclass(slots=True)
class ChoiceIndexer:
    """Choice index of completion j of prompt i: i * n + j, as OpenAI numbers them."""

    n: int
    progress: dict[int, ChoiceProgress] = field(default_factory=dict)

    def index(self, prompt_index: int, completion_index: int) -> int:
        return prompt_index * self.n + completion_index

    def of(self, index: int) -> ChoiceProgress:
        return self.progress.setdefault(index, ChoiceProgress())
