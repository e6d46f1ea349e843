"""What OpenAI's completions and chat completions share: the bounds this server sets on their fields, SamplingParams
errors as 400s, the reply's id, self-consistency's vote, and the streaming loop over their choices."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse

from tokenloop.engine.async_engine import RequestFailed
from tokenloop.outputs import CompletionOutput, RequestOutput
from tokenloop.server.errors import APIError
from tokenloop.server.generation import merge, until_disconnected
from tokenloop.server.protocol import ChatCompletionRequest, CompletionRequest
from tokenloop.server.responses import ChoiceIndexer, ChoiceProgress, Usage, prompt_logprobs
from tokenloop.strategies.self_consistency import AnswerSpec, VoteCounter


@dataclass(frozen=True, slots=True)
class Bounds:
    """The bounds that depend on this server (its --max-n, its context): field -> (largest value, why). The
    served schema states them too."""

    limits: dict[str, tuple[int, str]]

    @classmethod
    def of(cls, max_n: int, max_model_len: int) -> Bounds:
        context = (max_model_len - 1, f"the context is {max_model_len} tokens, the prompt at least one")
        max_n_bound = (max_n, "the server's --max-n")
        return cls({"n": max_n_bound, "best_of": max_n_bound, "max_tokens": context, "max_completion_tokens": context})

    def maxima(self) -> dict[str, int]:
        return {name: bound for name, (bound, _) in self.limits.items()}

    def check(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        for name, (bound, why) in self.limits.items():
            if (value := getattr(body, name, None)) is not None and value > bound:
                raise APIError(400, f"{name} must be at most {bound} ({why}), got {value}", name)
        if getattr(body, "best_of", None) is not None and body.best_of < body.n:
            raise APIError(400, f"best_of must be at least n ({body.n}), got {body.best_of}", "best_of")


def meta_of(prefix: str, kind: str, model_name: str) -> dict:
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()), "model": model_name}


def renamed_fields(body: CompletionRequest | ChatCompletionRequest) -> dict[str, str] | None:
    """A bad schema is named as the client sent it."""
    return {"structured_outputs.json": "response_format.json_schema.schema"} if body.response_format else None


async def voted(
    request: Request, stream: AsyncIterator[RequestOutput], spec: AnswerSpec, n: int, meta: dict, choice_of
) -> JSONResponse:
    """Self-consistency: count the samples' answers as they finish; once the leader cannot be overtaken, leave
    the stream (which aborts the samples still running). The reply's one choice is the first winning sample."""
    counter = VoteCounter(spec, n)

    async def count() -> RequestOutput:
        out = None
        try:
            async for out in stream:
                if counter.update(out):
                    break
        except RequestFailed as e:
            raise APIError(500, f"the engine failed this request: {e}") from None
        finally:
            await stream.aclose()
        return out

    last = await until_disconnected(request, count())
    result = counter.result()
    usage = Usage()
    usage.add(last)
    pick = result.winner or (result.samples[0] if result.samples else None)  # no sample answered: the first one
    choices = [choice_of(pick)] if pick is not None else []
    votes = {
        "answer": result.answer,
        "votes": result.votes,
        "confidence": result.confidence,
        "samples": len(result.samples),
        "stopped_early": result.stopped_early,
    }
    return JSONResponse(meta | {"choices": choices, "usage": usage.as_dict(), "self_consistency": votes})


async def choice_updates(
    streams: list[AsyncIterator[RequestOutput]], n: int, usage: dict[int, RequestOutput]
) -> AsyncIterator[tuple[int, RequestOutput, CompletionOutput, ChoiceProgress]]:
    """The one streaming loop of completions and chat: (choice index, output, completion, what was sent of it
    before), for every completion not finished yet; what was sent advances once the caller has taken an item.
    Each prompt's final output lands in `usage`."""
    indexer = ChoiceIndexer(n)
    async for i, out in merge(streams):
        for c in out.outputs:
            index = indexer.index(i, c.index)
            sent = indexer.of(index)
            if sent.finished:  # outputs repeat every completion of the request; a finished one was sent in full
                continue
            yield index, out, c, sent
            sent.text_len, sent.logprobs_len, sent.started, sent.finished = (
                len(c.text),
                len(c.token_ids),
                True,
                c.finish_reason is not None,
            )
        if out.finished:
            usage[i] = out


def usage_chunk(meta: dict, usage: dict[int, RequestOutput]) -> dict:
    total = Usage()
    for out in usage.values():
        total.add(out)
    return meta | {"choices": [], "usage": total.as_dict()}


def prompt_logprobs_field(body: CompletionRequest | ChatCompletionRequest, out: RequestOutput) -> dict:
    """vLLM's prompt_logprobs, when the request asked for them by that name."""
    return {"prompt_logprobs": prompt_logprobs(out)} if body.prompt_logprobs is not None else {}
