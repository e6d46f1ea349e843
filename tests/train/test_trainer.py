"""The training loop on the tiny model: metrics.jsonl's lines, evaluation only with max_steps 0, a loss that goes
down on data it sees again, and a run resumed from a checkpoint that goes on bit for bit as if uninterrupted."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tokenloop.train.config import TrainConfig
from tokenloop.train.trainer import train

TEXTS = [f"Example {i}: the cat sat on the mat number {i}." for i in range(24)]


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    return path


def run(model, data, output, **overrides) -> list[dict]:
    config = dict(model=str(model), data=str(data), output=str(output), row_len=64, batch_size=2, lr=1e-2)
    train(TrainConfig(**(config | overrides)), progress=False)
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]


def test_max_steps_zero_evaluates_only(tiny_model_folder, data, tmp_path):
    lines = run(tiny_model_folder, data, tmp_path / "out", max_steps=0)
    assert len(lines) == 1 and lines[0]["step"] == 0 and lines[0]["eval_loss"] > 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["metrics.jsonl"]


def test_every_step_is_logged_and_the_loss_goes_down(tiny_model_folder, data, tmp_path):
    lines = run(tiny_model_folder, data, tmp_path / "out", max_steps=12, warmup_steps=2)
    assert [line["step"] for line in lines] == list(range(13))
    assert set(lines[1]) == {"step", "loss", "lr", "tokens_per_s", "epoch"}
    assert set(lines[-1]) == {"step", "loss", "lr", "tokens_per_s", "epoch", "eval_loss"}
    assert lines[-1]["eval_loss"] < lines[0]["eval_loss"]
    assert lines[1]["lr"] == pytest.approx(1e-2 / 2) and lines[2]["lr"] == pytest.approx(1e-2)  # warm-up
    assert lines[-1]["lr"] < lines[3]["lr"]  # cosine decay


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_a_resumed_run_repeats_the_uninterrupted_loss_curve_bit_for_bit(tiny_model_folder, data, tmp_path, lora_rank):
    whole = run(tiny_model_folder, data, tmp_path / "whole", max_steps=6, save_every=3, lora_rank=lora_rank)
    assert (tmp_path / "whole" / "checkpoint-3").is_dir() and (tmp_path / "whole" / "checkpoint-6").is_dir()
    # A run stopped at step 3: its folder as the checkpoint left it, then --resume.
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    shutil.copytree(tmp_path / "whole" / "checkpoint-3", stopped / "checkpoint-3")
    (stopped / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in whole[:4]))
    resumed = run(tiny_model_folder, data, stopped, max_steps=6, save_every=3, lora_rank=lora_rank, resume=True)

    def curve(lines):
        return [(line["step"], line.get("loss"), line["lr"], line.get("eval_loss")) for line in lines]

    assert curve(resumed) == curve(whole)


def test_resume_without_a_checkpoint_is_a_clear_error(tiny_model_folder, data, tmp_path):
    with pytest.raises(ValueError, match="resume: no checkpoint-N/"):
        run(tiny_model_folder, data, tmp_path / "out", max_steps=2, resume=True)


@pytest.mark.parametrize(
    "field, value, message",
    [("lr", 0, "lr must be > 0"), ("batch_size", 0, "batch_size must be >= 1"), ("data", "/nope", "data: no such")],
)
def test_bad_settings_name_their_field(tmp_path, data, field, value, message):
    config = dict(data=str(data), output=str(tmp_path)) | {field: value}
    with pytest.raises(ValueError, match=message):
        TrainConfig(**config)


def test_ctrl_c_leaves_a_checkpoint_that_resume_goes_on_from(tiny_model_folder, data, tmp_path):
    out = tmp_path / "out"
    command = [sys.executable, "-m", "tokenloop.cli", "train", "--model", str(tiny_model_folder), "--data", str(data)]
    command += ["--output", str(out), "--max-steps", "1000000", "--row-len", "64", "--batch-size", "2"]

    def run_until_steps(extra: list[str], steps: int) -> subprocess.CompletedProcess:
        proc = subprocess.Popen(command + extra, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            metrics = out / "metrics.jsonl"
            if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
        return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)

    first = run_until_steps([], 4)
    assert first.returncode == 130, first.stderr
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    stopped_at = lines[-1]["step"]
    assert (out / f"checkpoint-{stopped_at}").is_dir() and f"stopped at step {stopped_at}" in first.stderr
    second = run_until_steps(["--resume"], len(lines) + 2)
    assert second.returncode == 130, second.stderr
    more = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in more] == list(range(len(more)))  # went on from the checkpoint's step
