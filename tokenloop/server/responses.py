"""OpenAI response bodies built from RequestOutputs: choices, logprobs, usage, stream chunks."""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field

from tokenloop.outputs import CompletionOutput, Logprob, RequestOutput, SpeculativeUsage
from tokenloop.tools.parser import parse_reply


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
    speculative: SpeculativeUsage | None = None

    def add(self, out: RequestOutput) -> None:
        self.prompt_tokens += len(out.prompt_token_ids)
        self.completion_tokens += sum(len(c.token_ids) for c in out.outputs)
        self.cached_tokens += out.num_cached_tokens
        if out.speculative is not None:
            self.speculative = self.speculative or SpeculativeUsage()
            self.speculative.add(out.speculative)

    def as_dict(self) -> dict:
        usage = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }
        if (s := self.speculative) is not None:  # tokenloop's extension, where the server decodes speculatively
            usage["speculative_decoding"] = {
                "draft_tokens": s.num_draft_tokens,
                "accepted_tokens": s.num_accepted_tokens,
                "drafts": s.num_drafts,
                "acceptance_rate": round(s.acceptance_rate, 4),
                "mean_accepted_length": round(s.mean_accepted_length, 4),
            }
        return usage


def _top(entries: dict[int, Logprob], k: int) -> list[Logprob]:
    return sorted((lp for lp in entries.values() if lp.rank is not None and lp.rank <= k), key=lambda lp: lp.rank)


def completion_logprobs(c: CompletionOutput, start: int, k: int, text_offset: int) -> dict:
    """The legacy completions format, for c's tokens from `start` on; offsets count from `text_offset`."""
    return legacy_logprobs(c.token_ids[start:], (c.logprobs or [])[start:], k, text_offset)


def legacy_logprobs(
    token_ids: list[int],
    entries_of: list[dict[int, Logprob] | None],
    k: int,
    text_offset: int,
    first_token: str | None = None,
) -> dict:
    """OpenAI's legacy logprobs of some tokens; a token without entries (a prompt's first: nothing before it
    to score it) has None, and the text `first_token`."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, entries in zip(token_ids, entries_of):
        if entries is None:
            token, logprob, top = first_token, None, None
        else:
            chosen = entries[token_id]
            token, logprob = chosen.decoded_token, chosen.logprob
            top = {lp.decoded_token: lp.logprob for lp in _top(entries, k)} | {token: logprob}
        tokens.append(token)
        token_logprobs.append(logprob)
        top_logprobs.append(top)
        offsets.append(text_offset)
        text_offset += len(token or "")
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def join_logprobs(first: dict, second: dict) -> dict:
    return {key: first[key] + second[key] for key in first}


def prompt_logprobs(out: RequestOutput) -> list[dict[str, dict] | None] | None:
    """vLLM's prompt_logprobs: per prompt token, {token id: {logprob, rank, decoded_token}}; None for the first."""
    if out.prompt_logprobs is None:
        return None
    return [
        None if entries is None else {str(t): dataclasses.asdict(lp) for t, lp in entries.items()}
        for entries in out.prompt_logprobs
    ]


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


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def chat_message(c: CompletionOutput, may_call_tools: bool) -> tuple[dict, str | None]:
    """The assistant message of a finished choice and its finish_reason: "tool_calls" when the reply is calls."""
    reply = parse_reply(c.text, finished=True) if may_call_tools else None
    if reply is None or not reply.calls:
        return {"role": "assistant", "content": c.text}, c.finish_reason
    calls = [
        {"id": _call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
        for call in reply.calls
    ]
    return {
        "role": "assistant",
        "content": reply.content or None,
        "tool_calls": calls,
    }, "tool_calls" if c.finish_reason == "stop" else c.finish_reason


@dataclass(slots=True)
class ToolCallStream:
    """What a stream has sent of a reply that may hold tool calls: content, then each call's id and name in its
    first delta and its arguments text piece by piece, as OpenAI streams them."""

    content_len: int = 0
    arguments_len: list[int] = field(default_factory=list)  # per call started

    def delta(self, text: str, finished: bool) -> dict:
        reply = parse_reply(text, finished)
        delta: dict = {}
        if content := reply.content[self.content_len :]:
            delta["content"] = content
            self.content_len = len(reply.content)
        calls = []
        for i, call in enumerate(reply.calls):
            if i == len(self.arguments_len):
                self.arguments_len.append(0)
                calls.append(
                    {"index": i, "id": _call_id(), "type": "function", "function": {"name": call.name, "arguments": ""}}
                )
            if piece := call.arguments[self.arguments_len[i] :]:
                if calls and calls[-1]["index"] == i:
                    calls[-1]["function"]["arguments"] = piece
                else:
                    calls.append({"index": i, "function": {"arguments": piece}})
                self.arguments_len[i] = len(call.arguments)
        if calls:
            delta["tool_calls"] = calls
        return delta

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.arguments_len else reason
