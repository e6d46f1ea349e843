"""The `tokenloop train` command line: TrainConfig's fields as flags."""

from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=None, help="known name, .gguf file or HF folder (default: the default)")
    p.add_argument("--data", required=True, help='JSONL: {"text"}, {"prompt", "completion"} or {"messages"} a line')
    p.add_argument("--eval-data", default=None, help="JSONL scored at the start and the end (default: --data)")
    p.add_argument("--output", "-o", required=True, help="the run's folder")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--epochs", type=float, default=1.0)
    length.add_argument("--max-steps", type=int, default=None, help="optimizer steps; 0 = evaluate only")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine decay down to lr * this")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="0 = no clipping")
    p.add_argument("--batch-size", type=int, default=4, help="packed rows per micro-batch")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--row-len", type=int, default=None, help="tokens per packed row (default min(context, 1024))")
    p.add_argument("--lora-rank", type=int, default=0, help="0 = full fine-tune")
    p.add_argument("--lora-alpha", type=float, default=None, help="default 2 * rank")
    p.add_argument("--merge", action="store_true", help="LoRA: also write the merged model to OUTPUT/merged")
    p.add_argument("--export-gguf", action="store_true", help="also write OUTPUT/model.gguf in the base GGUF's types")
    p.add_argument("--seed", type=int, default=0, help="the data order and LoRA's initialisation")
    p.add_argument("--save-every", type=int, default=0, help="steps between checkpoints (Ctrl-C saves one too)")
    p.add_argument("--eval-every", type=int, default=0, help="steps between evaluations besides first and last")
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--resume", action="store_true", help="go on from the newest OUTPUT/checkpoint-N")
    p.add_argument("--threads", type=int, default=None)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tokenloop.train.config import TrainConfig
    from tokenloop.train.trainer import train

    fields = {name: value for name, value in vars(args).items() if name not in ("func", "command")}
    try:
        result = train(TrainConfig(**fields))
    except ValueError as e:
        print(f"tokenloop train: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print(f"\ntokenloop train: {e}", file=sys.stderr)
        return 130
    print(f"{result.steps} steps; eval loss {result.first_eval_loss:.4f} -> {result.last_eval_loss:.4f}")
    return 0
