"""`tokenloop train`: full or LoRA fine-tuning of the serving model's own modules, in float32 from the GGUF's weights.

AdamW with linear warm-up and cosine decay, gradient accumulation and clipping; the loss of a step is the
token-weighted mean over all its micro-batches, so accumulation changes no figure. Every step's figures go to
output/metrics.jsonl; a checkpoint (every --save-every steps, and on Ctrl-C) lets --resume go on with the same
loss curve, bit for bit: the data order is a function of (seed, epoch) and the step runs in one order at the
checkpoint's thread count.
"""

from __future__ import annotations

import json
import math
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from tokenloop.models.loader import load_model
from tokenloop.train import checkpoint
from tokenloop.train.checkpoint import TrainState
from tokenloop.train.config import TrainConfig
from tokenloop.train.data import load_examples
from tokenloop.train.lora import add_lora
from tokenloop.train.outputs import write_outputs
from tokenloop.train.packing import PackedRow, batches, pack
from tokenloop.train.step import Batch, evaluate, learning_rate, summed_nll

DEFAULT_ROW_LEN = 1024


@dataclass(slots=True)
class TrainResult:
    steps: int
    first_eval_loss: float
    last_eval_loss: float
    metrics: list[dict] = field(default_factory=list)  # what this call wrote to metrics.jsonl


@dataclass(slots=True)
class _StopOnSignal:
    """Ctrl-C asks the loop to stop after the step under way (which then saves a checkpoint); a second Ctrl-C
    interrupts at once."""

    requested: bool = False
    previous: object = None  # the handler it replaces for the loop's duration

    def __enter__(self) -> _StopOnSignal:
        self.previous = signal.getsignal(signal.SIGINT)
        signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self.previous)

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True


def train(config: TrainConfig, progress: bool = True) -> TrainResult:
    output = Path(config.output)
    resume_from = checkpoint.newest(output) if config.resume else None
    if config.resume and resume_from is None:
        raise ValueError(f"resume: no {checkpoint.PREFIX}N/ in {output}")
    if resume_from is not None:
        torch.set_num_threads(json.loads((resume_from / "state.json").read_text())["threads"])
    elif config.threads is not None:
        torch.set_num_threads(config.threads)
    loaded = load_model(config.model, torch.float32, torch.device("cpu"))
    context = loaded.config.max_position_embeddings
    row_len = config.row_len or min(context, DEFAULT_ROW_LEN)
    if row_len > context:
        raise ValueError(f"row_len ({row_len}) must not exceed the model's context of {context} tokens")
    # every example is checked before any training starts
    rows = pack(load_examples(config.data, loaded.tokenizer, row_len), row_len)
    eval_rows = pack(load_examples(config.eval_data or config.data, loaded.tokenizer, row_len), row_len)
    model = loaded.model
    if config.lora_rank:
        torch.manual_seed(config.seed)  # LoRA's A is initialised at random
        add_lora(model, config.lora_rank, config.alpha)
    model.train()
    output.mkdir(parents=True, exist_ok=True)

    loop = TrainLoop(config, model, rows, eval_rows, torch.get_num_threads())
    if resume_from is not None:
        loop.state = checkpoint.load(resume_from, model, loop.optimizer, loop.schedule)
    result = loop.run(output, progress)
    model.eval()
    write_outputs(config, loaded, output)
    return result


class TrainLoop:
    def __init__(
        self, config: TrainConfig, model: nn.Module, rows: list[PackedRow], eval_rows: list[PackedRow], threads: int
    ) -> None:
        self.config, self.model, self.rows = config, model, rows
        self.eval_batches = [eval_rows[i : i + config.batch_size] for i in range(0, len(eval_rows), config.batch_size)]
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=config.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=config.weight_decay, fused=True
        )
        self.batches_per_epoch = math.ceil(len(rows) / config.batch_size)
        steps_per_epoch = math.ceil(self.batches_per_epoch / config.grad_accum)
        self.total_steps = (
            config.max_steps if config.max_steps is not None else math.ceil(config.epochs * steps_per_epoch)
        )
        total, warmup, floor = self.total_steps, min(config.warmup_steps, self.total_steps), config.min_lr_ratio
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: learning_rate(step, total, warmup, floor)
        )
        self.state = TrainState(0, 0, threads)
        self._epoch_batches: tuple[int, list[list[PackedRow]]] | None = None

    def micro_batch(self, index: int) -> Batch:
        """The index-th micro-batch of the run: epochs follow each other, each in its own (seed, epoch) order."""
        epoch, within = divmod(index, self.batches_per_epoch)
        if self._epoch_batches is None or self._epoch_batches[0] != epoch:
            self._epoch_batches = (epoch, batches(self.rows, self.config.batch_size, self.config.seed, epoch))
        return Batch.of(self._epoch_batches[1][within])

    def run(self, output: Path, progress: bool) -> TrainResult:
        metrics_path = output / "metrics.jsonl"
        if self.state.step == 0:
            metrics_path.write_text("")
        written: list[dict] = []

        def log(line: dict) -> None:
            written.append(line)
            with metrics_path.open("a") as f:
                f.write(json.dumps(line) + "\n")

        first_eval = last_eval = math.nan
        if self.state.step == 0:
            first_eval = last_eval = evaluate(self.model, self.eval_batches)
            log({"step": 0, "eval_loss": first_eval, "lr": self.schedule.get_last_lr()[0]})
        bar = tqdm(total=self.total_steps, initial=self.state.step, disable=not progress, unit="step")
        with _StopOnSignal() as stop:
            while self.state.step < self.total_steps and not stop.requested:
                line = self.step()
                if self.state.step == self.total_steps or (
                    self.config.eval_every and self.state.step % self.config.eval_every == 0
                ):
                    line["eval_loss"] = last_eval = evaluate(self.model, self.eval_batches)
                if self.state.step % self.config.log_every == 0 or "eval_loss" in line:
                    log(line)
                bar.update(1)
                bar.set_postfix(loss=f"{line['loss']:.4f}", tok_s=f"{line['tokens_per_s']:.0f}")
                if self.config.save_every and self.state.step % self.config.save_every == 0:
                    checkpoint.save(output, self.model, self.optimizer, self.schedule, self.state)
            if stop.requested:
                saved = checkpoint.save(output, self.model, self.optimizer, self.schedule, self.state)
                bar.close()
                raise KeyboardInterrupt(f"stopped at step {self.state.step}; {saved} resumes it (--resume)")
        bar.close()
        return TrainResult(self.state.step, first_eval, last_eval, written)

    def step(self) -> dict:
        """One optimizer step over grad_accum micro-batches; its metrics line."""
        start = time.perf_counter()
        micro = [self.micro_batch(self.state.micro_batches + i) for i in range(self.config.grad_accum)]
        scored = sum(b.num_scored for b in micro)
        lr = self.schedule.get_last_lr()[0]
        loss = 0.0
        for batch in micro:
            nll = summed_nll(self.model, batch)
            (nll / max(scored, 1)).backward()
            loss += nll.item()
        if self.config.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(self.params, self.config.max_grad_norm)
        self.optimizer.step()
        self.schedule.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.step += 1
        self.state.micro_batches += len(micro)
        elapsed = time.perf_counter() - start
        return {
            "step": self.state.step,
            "loss": loss / max(scored, 1),
            "lr": lr,
            "tokens_per_s": sum(b.num_tokens for b in micro) / elapsed,
            "epoch": self.state.micro_batches / self.batches_per_epoch,
        }
