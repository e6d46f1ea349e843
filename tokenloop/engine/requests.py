"""Request kinds: what a request's sampled rows mean, and what follows a step, behind one interface.

The engine's step is the same for every request; its kind decides through three hooks:
- `start`: its first sequence enters the scheduler (queued, or forked onto a finished request's blocks);
- `on_samples`: one of its sequences' rows of this step (appended as tokens, or kept as a beam's candidates);
- `after_step`: once the scheduler has stepped its sequences on: forks and ends, then its output, if any.

Kinds: SamplingRequest (n completions: the first prefills the prompt, the others fork off it once it has, sharing
its KV blocks), RetainedRequest (n = 1, whose finished sequence keeps its blocks for ForkedRequests, until
released), ForkedRequest (starts on a retained request's blocks, from any of its positions; only its suffix
is computed) and BeamRequest
(engine/beam_search.py: its beams are sequences forked and ended as the search ranks their rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tokenloop.engine.beam_search import Beam, BeamSearch, BeamSearchParams
from tokenloop.engine.input_processor import ProcessedPrompt
from tokenloop.engine.model_runner import StepSamples
from tokenloop.engine.output_processor import CompletionState, OutputProcessor
from tokenloop.engine.scheduler import Scheduler
from tokenloop.engine.sequence import Sequence, SequenceStatus
from tokenloop.outputs import Logprob, RequestOutput
from tokenloop.sampling.params import SamplingParams

if TYPE_CHECKING:
    from tokenloop.engine.lora import LoRASlot


@dataclass(frozen=True, slots=True)
class Fork:
    """Where a request starts on a finished, retained one: its prompt begins with that request's first `at` tokens
    (None: all of them), whose KV blocks it takes by reference. `continues_output`: its logits processors
    (penalties, min_tokens, bad words, the grammar) take the parent's output as the start of its own, as if one
    request went on (the explorer's branches); else its output starts after its prompt, as any request's."""

    request_id: str
    at: int | None = None
    continues_output: bool = False


class Engine(Protocol):
    """What a request kind may do to the engine's sequences."""

    scheduler: Scheduler

    def new_completion(self, request: Request) -> CompletionState:
        """The request's next completion: a sequence of its prompt, with its RNG, logits controls and detokenizer."""

    def keep(self, request_id: str, seq: Sequence) -> None:
        """Hold a finished sequence that keeps its blocks, for fork_request, until release_request."""


class Request:
    def __init__(
        self, request_id: str, processed: ProcessedPrompt, params: SamplingParams, lora: LoRASlot | None = None
    ) -> None:
        self.request_id = request_id
        self.lora = lora  # every sequence of the request runs its adapter (None: the base model)
        self.prompt = processed.prompt
        self.prompt_token_ids = processed.prompt_token_ids
        self.params = params
        self.completions: list[CompletionState] = []
        # Per prompt token, with params.prompt_logprobs: its logprob and the top k; None for the first (no context).
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        self.paused = False  # out of the batches until its reader catches up (LLMEngine.pause_request)
        # Where its output starts for the logits processors (None: after its prompt); a Fork may set it earlier.
        self.output_start: int | None = None
        self.retain = False  # n = 1: once finished, its sequence keeps its blocks for forks, until released

    @property
    def finished(self) -> bool:
        return len(self.completions) == self.params.n and all(c.finished for c in self.completions)

    def live_sequences(self) -> list[Sequence]:
        """Its sequences the scheduler still holds (one whose stop came in a step that then failed, too)."""
        return [c.seq for c in self.completions if c.seq.status is not SequenceStatus.FINISHED]

    def start(self, engine: Engine) -> None:
        raise NotImplementedError

    def on_samples(self, seq: Sequence, samples: StepSamples, rows: range, out: OutputProcessor) -> None:
        """A sampling sequence's tokens: appended one by one (a stop among a draft's accepted tokens drops the
        ones after it)."""
        completion = self.completions[seq.index]
        for row in rows:
            out.append(completion, samples, row)
            if completion.finished:
                break

    def after_step(self, engine: Engine, out: OutputProcessor) -> RequestOutput | None:
        if self.retain and self.finished:
            engine.keep(self.request_id, self.completions[0].seq)
        return out.make_output(self)


class SamplingRequest(Request):
    def start(self, engine: Engine) -> None:
        engine.scheduler.add(self._first(engine))

    def _first(self, engine: Engine) -> Sequence:
        seq = engine.new_completion(self).seq
        seq.keep_blocks = self.params.n > 1  # until the others have forked off it
        return seq

    def after_step(self, engine: Engine, out: OutputProcessor) -> RequestOutput | None:
        if len(self.completions) < self.params.n:  # the first has prefilled the prompt and sampled
            first = self.completions[0].seq
            try:
                for _ in range(self.params.n - 1):  # each computes the prompt's last token again, to sample its own
                    seq = engine.new_completion(self).seq
                    engine.scheduler.fork(first, seq, seq.num_prompt_tokens - 1)
                    if self.paused:
                        engine.scheduler.pause(seq)
            finally:  # forked or failed, the first keeps its blocks no longer
                if first.status is SequenceStatus.FINISHED:
                    engine.scheduler.release_kept(first)
                first.keep_blocks = False
        return super().after_step(engine, out)


class RetainedRequest(Request):
    def __init__(
        self, request_id: str, processed: ProcessedPrompt, params: SamplingParams, lora: LoRASlot | None = None
    ) -> None:
        super().__init__(request_id, processed, params, lora)
        self.retain = True

    def start(self, engine: Engine) -> None:
        seq = engine.new_completion(self).seq
        seq.keep_blocks = True
        engine.scheduler.add(seq)


class ForkedRequest(SamplingRequest):
    """Continues a finished, retained sequence from its first `at` tokens: its prompt is those tokens and a suffix,
    and only the suffix is computed; with n > 1 the others fork off its first once it has. `retain`: as a
    RetainedRequest, its finished sequence keeps its blocks (a branch of the explorer's tree)."""

    def __init__(
        self,
        request_id: str,
        processed: ProcessedPrompt,
        params: SamplingParams,
        parent: Sequence,
        at: int,
        retain: bool = False,
        continues_output: bool = False,
    ) -> None:
        super().__init__(request_id, processed, params, parent.lora)  # it continues its parent's K/V
        self.parent, self.at, self.retain = parent, at, retain
        if continues_output:
            start = (
                parent.controls.history.num_prompt_tokens if parent.controls is not None else parent.num_prompt_tokens
            )
            self.output_start = min(start, at)

    def start(self, engine: Engine) -> None:
        seq = self._first(engine)
        seq.keep_blocks = seq.keep_blocks or self.retain
        # Its last prompt token is computed again whatever it shares: its logits are what it samples from.
        shared = min(self.parent.num_computed_tokens, self.at, seq.num_tokens - 1)
        engine.scheduler.fork(self.parent, seq, shared)


class BeamRequest(Request):
    def __init__(
        self, request_id: str, processed: ProcessedPrompt, eos_token_ids: list[int], lora: LoRASlot | None = None
    ) -> None:
        beam_params: BeamSearchParams = processed.params
        super().__init__(request_id, processed, beam_params.sampling_params(), lora)
        self.search = BeamSearch(beam_params, frozenset(eos_token_ids), [])

    @property
    def finished(self) -> bool:
        return self.search.done

    def live_sequences(self) -> list[Sequence]:
        return [beam.seq for beam in self.search.beams]

    def start(self, engine: Engine) -> None:
        seq = self._beam(f"{self.request_id}/0", list(self.prompt_token_ids))
        self.search.beams = [Beam(seq, 0.0)]
        engine.scheduler.add(seq)

    def _beam(self, seq_id: str, token_ids: list[int]) -> Sequence:
        seq = Sequence(seq_id, token_ids, len(self.prompt_token_ids), self.params)
        seq.num_candidates = self.search.num_candidates
        seq.lora = self.lora
        return seq

    def on_samples(self, seq: Sequence, samples: StepSamples, rows: range, out: OutputProcessor) -> None:
        """Its row's best tokens wait for the other beams' rows."""
        self.search.add_row(seq, samples.logprob_token_ids[rows[0]][1:], samples.logprobs[rows[0]][1:])

    def after_step(self, engine: Engine, out: OutputProcessor) -> RequestOutput | None:
        """Once every live beam has its row: fork the continuations off their parents (first the forks, while
        the parents still hold only their own tokens; then each gets its token), end the beams nobody continues,
        and at the end return the output."""
        search = self.search
        if not search.ready:
            return None
        continuations = search.advance()
        taken: set[str] = set()
        seqs = []
        for c in continuations:
            parent = c.parent.seq
            if parent.seq_id in taken:
                child = self._beam(f"{self.request_id}/{next(search.beam_ids)}", list(parent.token_ids))
                engine.scheduler.fork(parent, child, parent.num_computed_tokens)
                seqs.append(child)
            else:
                taken.add(parent.seq_id)
                seqs.append(parent)
        for beam in search.beams:
            if beam.seq.seq_id not in taken:
                engine.scheduler.finish(beam.seq)
        for seq, c in zip(seqs, continuations):
            seq.token_ids.append(c.token_id)
        search.beams = [Beam(seq, c.logprob) for seq, c in zip(seqs, continuations)]
        return out.beam_output(self, search.best()) if search.done else None


def new_request(
    request_id: str,
    processed: ProcessedPrompt,
    retain: bool,
    eos_token_ids: list[int],
    lora: LoRASlot | None = None,
    fork_of: tuple[Sequence, Fork] | None = None,
) -> Request:
    """The kind of request `processed` asks for; `fork_of` (a retained sequence, and the Fork naming it, its `at`
    resolved) makes it a fork."""
    if isinstance(processed.params, BeamSearchParams):
        if fork_of is not None:
            raise ValueError("a beam search cannot be a fork of a retained request")
        return BeamRequest(request_id, processed, eos_token_ids, lora)
    if retain and processed.params.n != 1:
        raise ValueError(f"n must be 1 for a retained request, got {processed.params.n}")
    if fork_of is not None:
        parent, fork = fork_of
        return ForkedRequest(request_id, processed, processed.params, parent, fork.at, retain, fork.continues_output)
    return (RetainedRequest if retain else SamplingRequest)(request_id, processed, processed.params, lora)
