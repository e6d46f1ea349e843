"""checkpoint-N/: everything a run needs to go on as if it had not stopped (the trainable weights, the optimizer and
schedule, the RNG, the data position and the thread count), written atomically."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

PREFIX = "checkpoint-"


@dataclass(slots=True)
class TrainState:
    step: int  # optimizer steps done
    micro_batches: int  # micro-batches consumed: the data position
    threads: int


def save(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer, schedule: Any, state: TrainState) -> Path:
    target = folder / f"{PREFIX}{state.step}"
    partial = folder / f".{PREFIX}{state.step}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    trainable = {name: p.detach().contiguous() for name, p in model.named_parameters() if p.requires_grad}
    save_file(trainable, partial / "trainable.safetensors")
    torch.save(
        {"optimizer": optimizer.state_dict(), "schedule": schedule.state_dict(), "rng": torch.get_rng_state()},
        partial / "optimizer.pt",
    )
    (partial / "state.json").write_text(
        json.dumps({"step": state.step, "micro_batches": state.micro_batches, "threads": state.threads})
    )
    shutil.rmtree(target, ignore_errors=True)
    os.replace(partial, target)
    return target


def newest(folder: Path) -> Path | None:
    found = [p for p in folder.glob(f"{PREFIX}*") if p.is_dir() and p.name[len(PREFIX) :].isdigit()]
    return max(found, key=lambda p: int(p.name[len(PREFIX) :]), default=None)


def load(checkpoint: Path, model: nn.Module, optimizer: torch.optim.Optimizer, schedule: Any) -> TrainState:
    trainable = load_file(checkpoint / "trainable.safetensors")
    params = dict(model.named_parameters())
    if set(trainable) != {name for name, p in params.items() if p.requires_grad}:
        raise ValueError(f"resume: {checkpoint} holds other trainable weights than this run's (another --lora-rank?)")
    with torch.no_grad():
        for name, value in trainable.items():
            params[name].copy_(value)
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=False)
    optimizer.load_state_dict(saved["optimizer"])
    schedule.load_state_dict(saved["schedule"])
    torch.set_rng_state(saved["rng"])
    state = json.loads((checkpoint / "state.json").read_text())
    return TrainState(state["step"], state["micro_batches"], state["threads"])
