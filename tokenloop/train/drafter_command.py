"""`tokenloop train-drafter`: an EAGLE-1 drafter for a model, self-distilled: the model writes prompts and answers
them through the engine, its features are recorded, and a head is trained on them (train/drafter.py)."""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=None, help="the target: known name or .gguf file (default: the default)")
    p.add_argument("--output", "-o", required=True, help="the drafter's folder (config.json, model.safetensors)")
    p.add_argument("--dtype", default="auto", help="the path the drafter will serve beside (default: auto)")
    p.add_argument("--data", default=None, help="a folder of recorded features to reuse (default: OUTPUT/data)")
    p.add_argument("--prompts", type=int, default=256, help="conversations to record")
    p.add_argument("--max-tokens", type=int, default=256, help="answer tokens per conversation")
    p.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size (the answers' commonest)")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument(
        "--own-feature-passes",
        type=int,
        default=0,
        help="HASS-style passes in which the head reads its own features (default 0: EAGLE-1's training)",
    )
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from tokenloop import LLM
    from tokenloop.models.eagle import save_drafter
    from tokenloop.models.loader import load_model
    from tokenloop.train.drafter import DrafterTrainConfig, mean_top1, train_head
    from tokenloop.train.drafter_data import DistillConfig, collect
    from tokenloop.train.drafter_dataset import DrafterData

    started = time.perf_counter()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    output = Path(args.output)
    data_dir = Path(args.data) if args.data else output / "data"
    try:
        if (data_dir / "meta.json").is_file():
            data = DrafterData.load(data_dir)
        else:
            distill = DistillConfig(args.prompts, args.max_tokens, seed=args.seed, draft_vocab_size=args.draft_vocab)
            data = collect(LLM(args.model, dtype=args.dtype), distill)
            data.save(data_dir)
        config = DrafterTrainConfig(
            epochs=args.epochs, lr=args.lr, own_feature_passes=args.own_feature_passes, seed=args.seed
        )
        target = load_model(args.model, torch.float32, torch.device("cpu"), load_tokenizer=False)
        head, metrics = train_head(target, data, config)
    except ValueError as e:
        print(f"tokenloop train-drafter: {e}", file=sys.stderr)
        return 2
    save_drafter(head.to(torch.bfloat16), output)
    with (output / "metrics.jsonl").open("w") as f:
        f.writelines(json.dumps(line) + "\n" for line in metrics)
    coverage = data.info.get("draft_vocab_coverage", float("nan"))
    write_provenance(output, data.info, mean_top1(metrics), time.perf_counter() - started)
    print(
        f"{data.num_conversations} conversations, {data.num_answer_tokens} answer tokens, "
        f"draft vocabulary {len(data.draft_vocab)} (coverage {coverage:.3f}); "
        f"last steps' top-1 agreement {mean_top1(metrics):.3f}; drafter in {output}"
    )
    return 0


def write_provenance(output: Path, data_info: dict[str, Any], top1: float, seconds: float) -> None:
    """provenance.json beside the weights: the command and commit that made them, their sha256, the figures."""
    from tokenloop.bench.record import cpu_name, source_commit
    from tokenloop.models.eagle import PROVENANCE_FILE, WEIGHTS_FILE

    provenance = {
        "command": "tokenloop " + shlex.join(sys.argv[1:]),
        "commit": source_commit(),
        "cpu": cpu_name(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "sha256": hashlib.sha256((output / WEIGHTS_FILE).read_bytes()).hexdigest(),
        "seconds": round(seconds, 1),
        "last_steps_top1": round(top1, 4),
        "data": {k: data_info.get(k) for k in ("model", "engine_dtype", "prompt_source", "config", "figures")}
        | {"draft_vocab_coverage": data_info.get("draft_vocab_coverage")},
    }
    (output / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=1) + "\n")
