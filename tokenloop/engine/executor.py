"""StepExecutor: runs one scheduled batch through the model runner and keeps a failure to the request it belongs to.

Building a sequence's rows, sampling its row and (in the output processor) turning its tokens into text can fail
for one request: that request fails alone, the others go on. Only a failed forward pass, which no single request
can be blamed for, fails every request of its batch.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from tokenloop.engine.faults import FaultInjection, InjectedFault, inject
from tokenloop.engine.model_runner import ModelInput, ModelRunner, PromptScores, StepSamples
from tokenloop.engine.scheduler import ScheduledBatch

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StepResult:
    batch: ScheduledBatch  # what ran: sequences whose rows could not be built are left out
    samples: StepSamples | None = None
    sampled: dict[int, range] = field(default_factory=dict)  # batch index -> its rows of `samples`
    scores: list[PromptScores] = field(default_factory=list)
    failed: dict[str, Exception] = field(default_factory=dict)  # request id -> what failed it
    decode_cost: tuple[int, float] | None = None  # a decode-only step's query tokens, and its forward pass's seconds
    hidden: torch.Tensor | None = None  # [T, hidden]: each new token's final hidden state, in batch order (if kept)

    def fail(self, request_id: str, stage: str, error: Exception) -> None:
        """Record (and log, with the traceback unless a test injected it) that a request failed."""
        logger.error(
            "%s request %s failed: %s", stage, request_id, error, exc_info=not isinstance(error, InjectedFault)
        )
        self.failed.setdefault(request_id, error)

    def num_sampled(self) -> list[int | None]:
        """Per batch sequence: the tokens it sampled (0 for a prefill chunk), None when its request failed."""
        return [
            None if seq.request_id in self.failed else len(self.sampled.get(i, ()))
            for i, seq in enumerate(self.batch.seqs)
        ]


class StepExecutor:
    """The step's CPU threads: `threads`, less a core for each other job of this machine's that the engine knows
    of, when they are its own choice: the background compile, and (lend_cores) the server's input work. A step's
    threads meet at a barrier after every parallel region, so one thread that shares its core with other work
    holds them all up: on two cores a step stalled for a tenth of a second at a time while a prompt was
    tokenized beside it, and ran undisturbed on one thread."""

    def __init__(self, runner: ModelRunner, faults: list[FaultInjection], threads: int, adaptive: bool) -> None:
        self.runner = runner
        self.faults = faults
        self.threads = threads
        self.adaptive = adaptive  # the thread count is the engine's own choice (EngineConfig.threads unset)
        self.lent = 0  # cores lent to other work for now (AsyncEngine: while its input threads work)
        self._set_threads()

    def lend_cores(self, n: int) -> None:
        self.lent = n

    def _set_threads(self) -> None:
        compiling = self.runner.forward.worker is not None
        n = max(1, self.threads - (compiling + self.lent if self.adaptive else 0))
        if n != torch.get_num_threads():
            torch.set_num_threads(n)

    def execute(self, batch: ScheduledBatch) -> StepResult:
        self._set_threads()
        result = StepResult(batch)
        inp = self._prepare(result)
        if inp is not None:
            started = time.perf_counter()
            self._run(inp, result)
            if inp.decode_only and not result.failed:
                result.decode_cost = len(inp.input_ids), time.perf_counter() - started
        return result

    def _prepare(self, result: StepResult) -> ModelInput | None:
        """The step's tensors. If building them fails, each sequence is tried alone: the ones that fail are
        dropped from the step, the others run."""
        batch = result.batch
        try:
            for stage in ("stall", "die", "prepare"):
                inject(self.faults, stage, batch.seqs)
            return self.runner.prepare(batch)
        except Exception:
            pass
        kept = ScheduledBatch([], [], batch.block_copies)  # the copies are owed whoever fails
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            try:
                inject(self.faults, "prepare", [seq])
                self.runner.prepare(ScheduledBatch([seq], [n]))
            except Exception as e:
                result.fail(seq.request_id, "preparing", e)
                continue
            kept.seqs.append(seq)
            kept.num_new_tokens.append(n)
        result.batch = kept
        return self.runner.prepare(kept) if kept else None

    def _run(self, inp: ModelInput, result: StepResult) -> None:
        """The forward pass, then prompt scoring and sampling; a failed sampling is retried row by row, so that
        only the rows that fail are lost."""
        seqs = result.batch.seqs
        try:
            rows = self.runner.forward_rows(inp)
        except Exception as e:
            logger.exception("the forward pass failed: failing the %d requests of its batch", len(seqs))
            for seq in seqs:
                result.failed.setdefault(seq.request_id, e)
            return
        logits, result.hidden = rows.logits, rows.hidden
        if logits is None:
            return
        if any(span.num_scored for span in inp.spans):
            try:
                result.scores = self.runner.score(logits, inp, seqs)
            except Exception as e:
                for span in inp.spans:
                    if span.num_scored:
                        result.fail(seqs[span.seq_index].request_id, "scoring", e)
        if not inp.sample_spans:
            return
        logits = self.runner.sample_logits(logits, inp)
        sampling = [seqs[i] for i in inp.sample_seq_indices]
        try:
            inject(self.faults, "sample", sampling)
            result.samples = self.runner.sample(logits, sampling)
        except Exception:
            result.samples = self._sample_alone(logits, inp, sampling, result)
        result.sampled = dict(zip(inp.sample_seq_indices, result.samples.rows_of()))

    def _sample_alone(self, logits: torch.Tensor, inp: ModelInput, seqs: list, result: StepResult) -> StepSamples:
        parts, row = [], 0
        for span, seq in zip(inp.sample_spans, seqs):
            rows = slice(row, row + span.num_sampling_rows)
            row = rows.stop
            try:
                inject(self.faults, "sample", [seq])
                parts.append(self.runner.sample(logits[rows], [seq]))
            except Exception as e:
                result.fail(seq.request_id, "sampling", e)
                parts.append(StepSamples([-1], None, None, None, [1]))  # a placeholder row, never read
        return StepSamples.concat(parts)
