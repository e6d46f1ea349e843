"""`tokenloop batch IN.jsonl OUT.jsonl`: an offline batch on Ray Data, the engine as a callable class.

Each input line is a JSON object: "id" (unique), then "prompt" (text or token ids) or "messages" (a chat), and
optionally "sampling_params" (SamplingParams' fields). Each output line: "id", "text", "token_ids",
"finish_reason", "prompt_tokens". Outputs are written in the input's order as they come (Ray Data keeps the order),
one flushed line each, so a job stopped midway loses nothing written: run again, ids already in OUT are skipped.
A bad line (not JSON, no id, a repeated id, bad parameters, a prompt too long) is reported with its line number and
skipped; the others go on.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tokenloop.engine.config import EngineConfig
from tokenloop.sampling.params import SamplingParams


@dataclass(frozen=True, slots=True)
class Row:
    line: int  # 1-based, in IN
    id: str
    request: dict[str, Any]


def read_rows(path: Path, done: set[str]) -> tuple[list[Row], list[str]]:
    """The lines of IN still to run, and a message per bad line."""
    rows, errors, seen = [], [], set()
    with path.open() as f:
        for number, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                request = json.loads(text)
                if not isinstance(request, dict) or not isinstance(request.get("id"), str | int):
                    raise ValueError('a line is a JSON object with an "id" (a string or an integer)')
                if ("prompt" in request) == ("messages" in request):
                    raise ValueError('a line has a "prompt" or "messages" (one of them)')
            except ValueError as e:
                errors.append(f"line {number}: {e}")
                continue
            key = str(request["id"])
            if key in seen:
                errors.append(f"line {number}: id {key!r} is repeated (its first line runs)")
                continue
            seen.add(key)
            if key not in done:
                rows.append(Row(number, key, request))
    return rows, errors


def done_ids(path: Path) -> set[str]:
    """The ids OUT holds already (a last line cut short by a crash is dropped)."""
    if not path.exists():
        return set()
    ids, lines = set(), path.read_text().splitlines(keepends=True)
    good = 0
    for text in lines:
        try:
            ids.add(str(json.loads(text)["id"]))
            good += len(text)
        except (ValueError, KeyError):
            break
    if good != sum(map(len, lines)):
        with path.open("r+") as f:  # drop the torn tail, so that appended lines start on their own line
            f.truncate(good)
    return ids


class BatchEngine:
    """The engine as Ray Data's callable class: one per actor, a batch of rows per call, each row answered or
    given its error (never the batch's)."""

    def __init__(self, engine_config: dict[str, Any]) -> None:
        from tokenloop import LLM

        config = dict(engine_config)
        self.llm = LLM(config.pop("model"), **config)

    def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        prompts, params, results, good = [], [], [], []
        inputs = self.llm.llm_engine.input_processor
        for i, text in enumerate(batch["request"]):
            request = json.loads(text)
            try:
                sp = SamplingParams(**request.get("sampling_params", {}))
                prompt = request["prompt"] if "prompt" in request else self.llm.chat_prompt(request["messages"])
                if isinstance(prompt, list):
                    prompt = {"prompt_token_ids": prompt}
                inputs.process(prompt, sp)  # its checks, before it joins the others
            except (ValueError, TypeError) as e:
                results.append({"error": f"{type(e).__name__}: {e}"})
                continue
            prompts.append(prompt)
            params.append(sp)
            good.append(i)
            results.append(None)
        for i, out in zip(good, self.llm.generate(prompts, params, use_tqdm=False) if prompts else []):
            c = out.outputs[0]
            results[i] = {
                "text": c.text,
                "token_ids": list(c.token_ids),
                "finish_reason": c.finish_reason,
                "prompt_tokens": len(out.prompt_token_ids),
            }
        return {"id": list(batch["id"]), "line": list(batch["line"]), "result": [json.dumps(r) for r in results]}


def run_batch(
    source: Path, target: Path, engine_config: EngineConfig, replicas: int, batch_size: int, ray_address: str | None
) -> int:
    """Returns how many lines failed (reported on stderr)."""
    import ray

    done = done_ids(target)
    rows, errors = read_rows(source, done)
    for message in errors:
        print(f"{source}: {message}: skipped", file=sys.stderr)
    if done:
        print(f"{target}: {len(done)} ids done already: skipped", file=sys.stderr)
    if rows:
        ray.init(address=ray_address, include_dashboard=False, log_to_driver=False)
        try:
            errors += _run(rows, source, target, engine_config, replicas, batch_size)
        finally:
            ray.shutdown()
    return len(errors)


def _run(
    rows: list[Row], source: Path, target: Path, engine_config: EngineConfig, replicas: int, batch_size: int
) -> list[str]:
    import ray

    from tokenloop.scale_out.replica import replica_threads

    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True  # outputs in the input's order
    context.enable_progress_bars = False  # ours counts lines
    threads = replica_threads(engine_config, replicas)
    config = {f.name: getattr(engine_config, f.name) for f in dataclasses.fields(engine_config)} | {"threads": threads}
    # The id as its JSON (a string or an integer, written back as it came; one column type for Arrow).
    items = [{"id": json.dumps(r.request["id"]), "line": r.line, "request": json.dumps(r.request)} for r in rows]
    results = ray.data.from_items(items).map_batches(
        BatchEngine,
        fn_constructor_kwargs={"engine_config": config},
        batch_size=batch_size,
        compute=ray.data.ActorPoolStrategy(size=replicas),
        num_cpus=threads,
    )
    errors = []
    with target.open("a") as out, tqdm(total=len(rows), desc="batch", unit="line") as bar:
        for row in results.iter_rows():
            result, key = json.loads(row["result"]), json.loads(row["id"])
            if "error" in result:
                errors.append(message := f"line {row['line']} (id {key!r}): {result['error']}")
                print(f"{source}: {message}: skipped", file=sys.stderr)
            else:
                out.write(json.dumps({"id": key} | result) + "\n")
                out.flush()
            bar.update(1)
    return errors


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", type=Path, help="JSON lines: id, prompt or messages, sampling_params")
    parser.add_argument("output", type=Path, help="JSON lines, in the input's order; ids in it already are skipped")
    parser.add_argument("--replicas", type=int, default=1, help="engines on Ray Data (each a callable class actor)")
    parser.add_argument("--batch-size", type=int, default=32, help="lines per engine call")
    parser.add_argument("--ray-address", default=None, help="a Ray cluster to join (default: start one)")
