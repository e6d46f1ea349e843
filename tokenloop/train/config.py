"""TrainConfig: what one `tokenloop train` run does, checked before any data is read."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(slots=True)
class TrainConfig:
    data: str  # JSONL: {"text"}, {"prompt", "completion"} or {"messages"} per line
    output: str  # the run's folder: metrics.jsonl, checkpoint-N/, then the model or adapter
    model: str | None = None  # a known name, .gguf file or HF folder (default: the default model)
    eval_data: str | None = None  # scored at the start and the end (and every eval_every steps); default: `data`
    epochs: float = 1.0
    max_steps: int | None = None  # overrides epochs; 0 = evaluate only
    lr: float = 2e-4
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    warmup_steps: int = 10  # linear warm-up from lr / warmup_steps
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0  # 0 = no clipping
    batch_size: int = 4  # packed rows per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    row_len: int | None = None  # tokens per packed row (default: min(context, 1024))
    lora_rank: int = 0  # 0 = full fine-tune
    lora_alpha: float | None = None  # default: 2 * lora_rank
    seed: int = 0  # the data order
    save_every: int = 0  # steps between checkpoints (0 = at the end and on Ctrl-C only)
    eval_every: int = 0  # steps between evaluations besides the first and last (0 = none)
    log_every: int = 1
    resume: bool = False  # continue from the newest checkpoint-N/ in output
    merge: bool = False  # LoRA: also write the merged model to output/merged
    export_gguf: bool = False  # also write output/model.gguf in the base GGUF's types
    threads: int | None = None  # torch threads (default: torch's); a checkpoint keeps it, --resume restores it

    def __post_init__(self) -> None:
        checks = [
            ("epochs", self.epochs > 0, "must be > 0"),
            ("max_steps", self.max_steps is None or self.max_steps >= 0, "must be >= 0"),
            ("lr", self.lr > 0, "must be > 0"),
            ("min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "must be in [0, 1]"),
            ("warmup_steps", self.warmup_steps >= 0, "must be >= 0"),
            ("weight_decay", self.weight_decay >= 0, "must be >= 0"),
            ("max_grad_norm", self.max_grad_norm >= 0, "must be >= 0"),
            ("batch_size", self.batch_size >= 1, "must be >= 1"),
            ("grad_accum", self.grad_accum >= 1, "must be >= 1"),
            ("row_len", self.row_len is None or self.row_len >= 2, "must be >= 2"),
            ("lora_rank", self.lora_rank >= 0, "must be >= 0"),
            ("lora_alpha", self.lora_alpha is None or self.lora_alpha > 0, "must be > 0"),
            ("save_every", self.save_every >= 0, "must be >= 0"),
            ("eval_every", self.eval_every >= 0, "must be >= 0"),
            ("log_every", self.log_every >= 1, "must be >= 1"),
            ("threads", self.threads is None or self.threads >= 1, "must be >= 1"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"{name} {rule}, got {getattr(self, name)}")
        if self.merge and not self.lora_rank:
            raise ValueError("merge: only with lora_rank > 0 (a full fine-tune is written merged)")
        for name in ("data", "eval_data"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name}: no such file: {path}")

    @property
    def alpha(self) -> float:
        return self.lora_alpha if self.lora_alpha is not None else 2.0 * self.lora_rank

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
