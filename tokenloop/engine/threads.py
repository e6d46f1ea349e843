"""How many CPU threads a step uses when the caller does not say: one per core that is idle at start.

A decode step reads every weight once: it is bound by memory bandwidth, which one thread nearly saturates. A
thread on a core that another process keeps busy only makes each parallel region wait for it: with one of two
cores taken, two threads decode at a third of the speed one thread keeps. So cores that are busy when the engine
starts are left to their owner.
"""

from __future__ import annotations

import os
import time

import torch

# torch's default (one thread per physical core, or what the caller set before loading tokenloop), taken once:
# an engine's own choice must not lower the next engine's starting point.
CORES = torch.get_num_threads()


def _cpu_times() -> tuple[int, int]:
    """(idle, total) jiffies of all CPUs since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return idle, sum(fields[:8])


def idle_cores(sample_s: float = 0.1) -> float:
    """How many of the machine's CPUs were idle over `sample_s` seconds."""
    idle0, total0 = _cpu_times()
    time.sleep(sample_s)
    idle1, total1 = _cpu_times()
    return (idle1 - idle0) / max(total1 - total0, 1) * (os.cpu_count() or 1)


def default_threads() -> int:
    """torch's default (one thread per physical core), less the cores other processes keep busy."""
    try:
        idle = idle_cores()
    except (OSError, ValueError, IndexError):  # no /proc/stat: not Linux
        return CORES
    return max(1, min(CORES, round(idle)))
