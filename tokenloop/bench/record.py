"""`tokenloop bench ... --record`: keep a run's report with where and how it was measured.

Each recorded run appends one JSON line to benchmarks/results/<kind>.jsonl of the source checkout (KINDS), then
docs/benchmarks.md is written anew from every line, newest first, and the README's one table (between its
`bench:start` and `bench:end` markers) is the newest offline run of the default model.
Figures in the docs come from here, never typed in by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

KINDS = {
    "offline": "`tokenloop bench`: tokenloop beside llama.cpp's `llama-bench` on the same GGUF",
    "serve": "`tokenloop bench serve --peer llama-server`: the servers under the same load, one at a time",
    "speculative": "`tokenloop bench --speculative`: speculative decoding against tokenloop's own decode",
    "frontend": "`tokenloop bench frontend`: a running stream and /health while input work runs beside them",
    "train": "`tokenloop bench train`: training tokens/s and memory beside transformers + peft, same data",
    "pd": "`tokenloop bench pd`: colocated serving against prefill/decode disaggregation, one mixed load",
    "route": "`tokenloop bench route`: the replica routers on a multi-tenant load",
    "kv": "`tokenloop bench kv`: the int8 KV cache against the 16-bit one",
}
START, END = "<!-- bench:start -->", "<!-- bench:end -->"
RECORD_WRITES = ("README.md", "docs/benchmarks.md", "benchmarks/results")


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--record",
        action="store_true",
        help=(
            "append the run to benchmarks/results/ and rewrite docs/benchmarks.md and the README's table "
            "(a source checkout)"
        ),
    )


def checkout() -> Path:
    root = Path(__file__).resolve().parents[2]
    if not (root / "pyproject.toml").exists() or not (root / "benchmarks").is_dir():
        raise ValueError(f"--record writes into a source checkout of tokenloop; this one runs from {root}")
    return root


def _git(root: Path, *args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True).stdout.strip()
    except OSError:  # no git
        return ""


def source_commit(root: Path | None = None) -> str:
    """The checkout's short commit, "+changes" where its tracked files differ from it (what --record itself writes
    does not count); "unknown" outside a git checkout."""
    root = root or Path(__file__).resolve().parents[2]
    commit = _git(root, "rev-parse", "--short", "HEAD") or "unknown"
    if _git(root, "status", "--porcelain", "--untracked-files=no", "--", ".", *(f":!{p}" for p in RECORD_WRITES)):
        commit += "+changes"  # measured on a tree that differs from the commit
    return commit


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return f"{names[0] if names else platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def save(kind: str, report: str, root: Path | None = None) -> Path:
    """Append this run's report to the results and rewrite the docs; returns the results file."""
    root = root or checkout()
    commit = source_commit(root)
    row = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": commit,
        "cpu": cpu_name(),
        "command": "tokenloop " + shlex.join(sys.argv[1:]),
        "report": report,
    }
    results = _results(root, kind)
    results.parent.mkdir(parents=True, exist_ok=True)
    with results.open("a") as f:
        f.write(json.dumps(row) + "\n")
    render(root)
    return results


def _results(root: Path, kind: str) -> Path:
    return root / "benchmarks" / "results" / f"{kind}.jsonl"


def load(root: Path, kind: str) -> list[dict]:
    path = _results(root, kind)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _entry(row: dict) -> str:
    return f"{row['date']}, commit {row['commit']}, {row['cpu']}: `{row['command']}`\n\n```\n{row['report']}\n```\n"


def _newest(rows: list[dict]) -> dict:
    """The README's run of a kind: the newest of the default model (a command naming no --model), else the newest."""
    default = [row for row in rows if not {"--model", "-m"} & set(shlex.split(row["command"]))]
    return (default or rows)[-1]


def render(root: Path) -> None:
    parts = [
        "# Benchmarks\n",
        "Written by `tokenloop bench ... --record` from `benchmarks/results/*.jsonl`; do not edit by hand. "
        "The machine's speed drifts by more than 10% within an hour, so compare figures within one run "
        "(every table has its peer, measured in the same run), not across rows. "
        "[benchmark-notes.md](benchmark-notes.md) keeps the earlier runs and the profiles behind them.\n",
    ]
    for kind, title in KINDS.items():
        rows = load(root, kind)
        if rows:
            parts.append(f"## {title}\n")
            parts += [_entry(row) for row in reversed(rows)]
    (root / "docs").mkdir(exist_ok=True)
    (root / "docs" / "benchmarks.md").write_text("\n".join(parts))
    readme = root / "README.md"
    text = readme.read_text()
    if START in text and END in text:
        rows = load(root, "offline")
        body = _entry(_newest(rows)) if rows else "No run recorded yet: `tokenloop bench --record`.\n"
        head, rest = text.split(START, 1)
        readme.write_text(f"{head}{START}\n{body}{END}{rest.split(END, 1)[1]}")
