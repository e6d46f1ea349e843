"""`tokenloop bench train`: training tokens per second and peak memory, tokenloop beside transformers + peft on the
same model, data and settings, in one run.

Each row trains the same float32 weights (the GGUF dequantized) on the same token rows (one whole sequence of
--row-len tokens per row, --batch-size rows a step, every token scored), with fused AdamW and clipping, full or LoRA
(the same rank and alpha on the same seven projections): tokenloop through its own training loop (TrainLoop.step),
transformers through `model(input_ids, labels=...)`, peft's `get_peft_model` for LoRA. Every measurement runs in a
process of its own, one at a time, so its peak RSS is its own; a step's rate is tokens over its wall time, the
best of the timed steps after one warm-up step.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

from tokenloop.bench import record
from tokenloop.bench.common import DEFAULT_PROMPT

ENGINES = ("tokenloop", "transformers")
HF_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def token_rows(tokenizer, row_len: int, count: int) -> list[list[int]]:
    ids: list[int] = []
    while len(ids) < row_len * count:
        ids += tokenizer.encode(DEFAULT_PROMPT, add_special_tokens=False)
    return [ids[i * row_len : (i + 1) * row_len] for i in range(count)]


def _tokenloop_rates(model_path: str, args: argparse.Namespace) -> list[float]:
    from tokenloop.models.loader import load_model
    from tokenloop.train.config import TrainConfig
    from tokenloop.train.data import Example
    from tokenloop.train.lora import add_lora
    from tokenloop.train.packing import pack
    from tokenloop.train.trainer import TrainLoop

    loaded = load_model(model_path, torch.float32, torch.device("cpu"))
    rows = token_rows(loaded.tokenizer, args.row_len, args.batch_size)
    examples = [Example(tuple(r), (False,) + (True,) * (len(r) - 1), i + 1) for i, r in enumerate(rows)]
    packed = pack(examples, args.row_len)
    if args.lora_rank:
        torch.manual_seed(0)
        add_lora(loaded.model, args.lora_rank, 2.0 * args.lora_rank)
    loaded.model.train()
    config = TrainConfig(data=__file__, output="unused", batch_size=args.batch_size, lora_rank=args.lora_rank)
    loop = TrainLoop(config, loaded.model, packed, packed, torch.get_num_threads())
    return [loop.step()["tokens_per_s"] for _ in range(args.steps + 1)][1:]


def _transformers_rates(model_path: str, args: argparse.Namespace) -> list[float]:
    from pathlib import Path

    import transformers

    path = Path(model_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    rows = torch.tensor(token_rows(tokenizer, args.row_len, args.batch_size))
    if args.lora_rank:
        import peft

        torch.manual_seed(0)
        config = peft.LoraConfig(
            r=args.lora_rank, lora_alpha=2 * args.lora_rank, lora_dropout=0.0, target_modules=HF_LORA_TARGETS
        )
        model = peft.get_peft_model(model, config)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=2e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, fused=True)
    rates = []
    for _ in range(args.steps + 1):
        start = time.perf_counter()
        model(input_ids=rows, labels=rows).loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        rates.append(rows.numel() / (time.perf_counter() - start))
    return rates[1:]


def worker(args: argparse.Namespace) -> None:
    """One measurement, in this process: prints {"tokens_per_s", "peak_rss_mib"} as JSON."""
    from tokenloop.models.store import resolve

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model_path = str(resolve(args.model))
    rates = (_tokenloop_rates if args.worker == "tokenloop" else _transformers_rates)(model_path, args)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"tokens_per_s": max(rates), "peak_rss_mib": peak}))


def measure(engine: str, args: argparse.Namespace, lora_rank: int) -> dict:
    command = [sys.executable, "-m", "tokenloop.bench.train", "--worker", engine, "--lora-rank", str(lora_rank)]
    for flag in ("model", "steps", "batch_size", "row_len", "threads"):
        if (value := getattr(args, flag)) is not None:
            command += [f"--{flag.replace('_', '-')}", str(value)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(results: dict[tuple[str, str], dict], args: argparse.Namespace) -> str:
    threads = args.threads or torch.get_num_threads()
    lines = [
        f"tokenloop bench train: {args.model or 'default model'}, float32, {threads} threads, "
        f"{args.batch_size} rows x {args.row_len} tokens a step, fused AdamW, best of {args.steps} steps",
        f"{'':40}{'tokenloop':>12}{'transformers':>14}{'ratio':>8}",
    ]
    for mode in ("full", f"LoRA r={args.lora_rank}"):
        ours, theirs = results[("tokenloop", mode)], results[("transformers", mode)]
        for label, key, fmt in (("training tokens/s", "tokens_per_s", ".1f"), ("peak RSS, MiB", "peak_rss_mib", ".0f")):
            a, b = ours[key], theirs[key]
            lines.append(f"{mode + ', ' + label:40}{a:>12{fmt}}{b:>14{fmt}}{a / b:>7.2f}x")
    lines.append("transformers: + peft for LoRA; ratio = tokenloop / transformers; each row in its own process")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="a known name or .gguf file (default: the default model)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--row-len", type=int, default=256)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    record.add_argument(parser)


def main_from_args(args: argparse.Namespace) -> int:
    results = {}
    for mode, rank in (("full", 0), (f"LoRA r={args.lora_rank}", args.lora_rank)):
        for engine in ENGINES:
            results[(engine, mode)] = measure(engine, args, rank)
    text = report(results, args)
    print(text)
    if args.record:
        record.save("train", text)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parser.add_argument("--worker", choices=ENGINES, required=True)
    worker(parser.parse_args())
