"""The default thread count leaves a core that another process keeps busy to that process."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from tokenloop.engine.threads import CORES, default_threads, idle_cores


@pytest.mark.skipif(CORES < 2, reason="needs two cores")
def test_a_core_kept_busy_by_another_process_is_not_used():
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        assert idle_cores() <= CORES - 0.5
        assert 1 <= default_threads() <= CORES - 1
    finally:
        hog.kill()


def test_the_default_does_not_follow_what_an_earlier_engine_set(monkeypatch):
    from tokenloop.engine import threads

    monkeypatch.setattr(threads, "idle_cores", lambda: float(CORES))  # every core idle again
    torch.set_num_threads(1)  # as an engine started on a busy machine leaves it
    try:
        assert threads.default_threads() == CORES
    finally:
        torch.set_num_threads(CORES)


def test_an_explicit_thread_count_is_checked(tiny_model_folder):
    from tokenloop.engine.config import EngineConfig

    with pytest.raises(ValueError, match="threads must be an integer >= 1"):
        EngineConfig(str(tiny_model_folder), threads=0)
