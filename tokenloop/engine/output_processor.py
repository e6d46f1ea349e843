"""Output processing: append sampled tokens, detokenize, decide when a request stops, build its output."""

from __future__ import annotations

from dataclasses import dataclass

from tokenloop.engine.sequence import Sequence
from tokenloop.outputs import CompletionOutput, Logprob, RequestOutput
from tokenloop.sampling.sampler import SamplerOutput
from tokenloop.tokenizer.detokenizer import IncrementalDetokenizer
from tokenloop.tokenizer.tokenizer import Tokenizer


@dataclass(slots=True)
class RequestState:
    seq: Sequence
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    streamed_text: str = ""  # text safe to show so far (a possible stop-string prefix is held back)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = set(tokenizer.eos_token_ids)
        self.max_model_len = max_model_len

    def append(self, state: RequestState, samples: SamplerOutput, row: int) -> None:
        """Add the token sampled at `row` to the request; marks it finished when a stop condition holds."""
        seq, params = state.seq, state.seq.params
        token = int(samples.token_ids[row])
        seq.token_ids.append(token)
        if samples.logprobs is not None:
            chosen = float(samples.logprobs[row, 0])
            state.cumulative_logprob += chosen
            if params.logprobs is not None:
                state.logprobs = state.logprobs if state.logprobs is not None else []
                state.logprobs.append(self._logprob_dict(samples, row, params.logprobs))
        stop_string = state.detokenizer.update([token])
        if stop_string is not None:
            seq.finish_reason, seq.stop_reason = "stop", stop_string
        elif token in self.eos_token_ids and not params.ignore_eos:
            seq.finish_reason = "stop"
        elif token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
        state.streamed_text += state.detokenizer.stream_delta(finished=seq.finish_reason is not None)

    def _logprob_dict(self, samples: SamplerOutput, row: int, k: int) -> dict[int, Logprob]:
        """The chosen token first, then the top k (the chosen one may be among them: k or k + 1 entries)."""
        ids = samples.logprob_token_ids[row, : k + 1].tolist()
        values = samples.logprobs[row, : k + 1].tolist()
        entries = {ids[0]: Logprob(values[0], int(samples.ranks[row]), self.tokenizer.decode([ids[0]]))}
        for rank, (tid, lp) in enumerate(zip(ids[1:], values[1:]), start=1):
            entries.setdefault(tid, Logprob(lp, rank, self.tokenizer.decode([tid])))
        return entries

    def make_output(self, state: RequestState) -> RequestOutput:
        seq = state.seq
        finished = seq.finish_reason is not None
        completion = CompletionOutput(
            index=0,
            text=state.detokenizer.output_text if finished else state.streamed_text,
            token_ids=list(seq.output_token_ids),
            cumulative_logprob=state.cumulative_logprob if seq.params.logprobs is not None else None,
            logprobs=state.logprobs,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )
        return RequestOutput(
            request_id=seq.request_id,
            prompt=state.prompt,
            prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens],
            outputs=[completion],
            finished=finished,
            num_cached_tokens=seq.num_cached_tokens,
        )
