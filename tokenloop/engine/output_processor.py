"""Output processing: append sampled tokens, detokenize, decide when a completion stops, build request outputs.

Outputs are built incrementally: while a request runs, each step's output shows its tokens and logprobs through a
read-only Prefix of the lists the engine appends to (a copy every step would cost O(L²) over a completion's length);
its last output holds lists of its own.
"""

from __future__ import annotations

from collections.abc import Sequence as ReadOnly
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenloop.engine.beam_search import Hypothesis
from tokenloop.engine.executor import StepResult
from tokenloop.engine.faults import FaultInjection, inject
from tokenloop.engine.model_runner import PromptScores, StepSamples
from tokenloop.engine.sequence import Sequence
from tokenloop.outputs import CompletionOutput, Logprob, Prefix, RequestOutput, SpeculativeUsage
from tokenloop.tokenizer.detokenizer import IncrementalDetokenizer
from tokenloop.tokenizer.tokenizer import Tokenizer

if TYPE_CHECKING:
    from tokenloop.engine.requests import Request

# stop_reason of a structured request whose grammar the token bans left no token to choose.
DEAD_END = "no token left: the grammar allows only banned tokens (bad_words, allowed_token_ids or min_tokens)"


@dataclass(slots=True)
class CompletionState:
    """One of a request's n completions: its sequence and the text and logprobs built so far."""

    index: int
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    streamed_text: str = ""  # text safe to show so far (a possible stop-string prefix is held back)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0

    @property
    def finished(self) -> bool:
        return self.seq.finish_reason is not None


class OutputProcessor:
    def __init__(
        self, tokenizer: Tokenizer, max_model_len: int, speculative: bool, faults: list[FaultInjection]
    ) -> None:
        self.tokenizer = tokenizer
        self.speculative = speculative  # outputs carry their request's SpeculativeUsage
        self.eos_token_ids = set(tokenizer.eos_token_ids)
        self.max_model_len = max_model_len
        self.faults = faults

    def process(self, result: StepResult, requests: dict[str, Request]) -> list[Request]:
        """Each request's part of a step, for the requests that did not fail: the prompt logprobs scored, then
        the tokens sampled (Request.on_samples: appended and checked for stops, or a beam's row kept). Returns the
        requests that got tokens, in the batch's order."""
        for score in result.scores:
            seq = result.batch.seqs[score.seq_index]
            if seq.request_id not in result.failed:
                self.append_prompt_logprobs(requests[seq.request_id], seq, score)
        progressed: dict[str, Request] = {}
        for index, rows in result.sampled.items():
            seq = result.batch.seqs[index]
            if seq.request_id in result.failed:
                continue
            request = requests[seq.request_id]
            try:
                inject(self.faults, "detokenize", [seq])
                request.on_samples(seq, result.samples, rows, self)
            except Exception as e:
                result.fail(request.request_id, "updating", e)
                continue
            progressed[request.request_id] = request
        return [request for request in progressed.values() if request.request_id not in result.failed]

    def append(self, state: CompletionState, samples: StepSamples, row: int) -> None:
        """Add the token sampled at `row` to a completion; marks it finished when a stop condition holds."""
        seq, params = state.seq, state.seq.params
        token = samples.token_ids[row]
        dead_end = seq.controls is not None and len(seq.token_ids) in seq.controls.dead_ends
        seq.token_ids.append(token)
        if samples.logprobs is not None and params.logprobs is not None:
            state.cumulative_logprob += samples.logprobs[row][0]
            state.logprobs = state.logprobs if state.logprobs is not None else []
            state.logprobs.append(self._logprob_dict(samples, row, params.logprobs))
        stop_string = state.detokenizer.update([token])
        if dead_end:  # the grammar allowed only tokens that bad_words, allowed_token_ids or min_tokens ban
            seq.finish_reason, seq.stop_reason = "stop", DEAD_END
        elif stop_string is not None:
            seq.finish_reason, seq.stop_reason = "stop", stop_string
        elif token in self.eos_token_ids and not params.ignore_eos:
            seq.finish_reason = "stop"
        elif token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
        state.streamed_text += state.detokenizer.stream_delta(finished=seq.finish_reason is not None)

    def append_prompt_logprobs(self, request: Request, seq: Sequence, scores: PromptScores) -> None:
        """Store the logprobs of prompt tokens scored this step; a position scored before (the prompt was
        recomputed after a preemption) is kept as it was."""
        for row in range(len(scores.samples.token_ids)):
            if scores.first_position + row == len(request.prompt_logprobs):
                request.prompt_logprobs.append(self._logprob_dict(scores.samples, row, request.params.prompt_logprobs))
        if len(request.prompt_logprobs) == seq.num_prompt_tokens:
            seq.score_prompt = False  # scored in full: a recompute may take its blocks from the prefix cache

    def _logprob_dict(self, samples: StepSamples, row: int, k: int) -> dict[int, Logprob]:
        """The chosen token first, then the top k (the chosen one may be among them: k or k + 1 entries)."""
        ids = samples.logprob_token_ids[row][: k + 1]
        values = samples.logprobs[row][: k + 1]
        entries = {ids[0]: Logprob(values[0], samples.ranks[row], self.tokenizer.decode([ids[0]]))}
        for rank, (tid, lp) in enumerate(zip(ids[1:], values[1:]), start=1):
            entries.setdefault(tid, Logprob(lp, rank, self.tokenizer.decode([tid])))
        return entries

    def make_output(self, request: Request, finished: bool | None = None) -> RequestOutput:
        """The request's output so far; `finished` overrides whether it is the last one (an abort)."""
        finished = request.finished if finished is None else finished

        def shown(items: list | None, start: int = 0) -> ReadOnly | None:
            """A running request's lists as read-only views; the last output's as copies of its own."""
            return None if items is None else items[start:] if finished else Prefix(items, start)

        completions = [
            CompletionOutput(
                index=c.index,
                text=c.detokenizer.output_text if c.finished else c.streamed_text,
                token_ids=shown(c.seq.token_ids, c.seq.num_prompt_tokens),
                cumulative_logprob=c.cumulative_logprob if request.params.logprobs is not None else None,
                logprobs=shown(c.logprobs),
                finish_reason=c.seq.finish_reason,
                stop_reason=c.seq.stop_reason,
            )
            for c in request.completions
        ]
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=completions,
            finished=finished,
            num_cached_tokens=request.completions[0].seq.num_cached_tokens if request.completions else 0,
            prompt_logprobs=shown(request.prompt_logprobs),
            speculative=self._speculative_usage(request) if self.speculative else None,
        )

    def beam_output(self, request: Request, best: list[Hypothesis]) -> RequestOutput:
        """A finished beam search's one output: its best hypotheses, best first."""
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
            for i, h in enumerate(best)
        ]
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions, finished=True)

    @staticmethod
    def _speculative_usage(request: Request) -> SpeculativeUsage:
        usage = SpeculativeUsage()
        for c in request.completions:
            usage.add(SpeculativeUsage(c.seq.num_drafts, c.seq.num_draft_tokens, c.seq.num_accepted_tokens))
        return usage
