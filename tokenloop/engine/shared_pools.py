"""KV pools in shared memory: each pool a file in /dev/shm that the engine maps shared, so that another process
(a decode worker, disaggregation/) can map it too and copy blocks out of it, with no KV bytes through a pipe.

The files are sparse, like the private pools (engine/model_runner.py's zeroed_pool): a page takes memory once a
token is written there. Their names carry the engine's name, and the engine's process removes them at exit; the
one that started it removes them too, should it die first.
"""

from __future__ import annotations

import glob
import math
import mmap
import os

import torch

SHM_DIR = "/dev/shm"


def pool_paths(name: str) -> list[str]:
    """The pool files an engine named `name` made, in the order it made them (layer after layer, K then V)."""
    paths = glob.glob(os.path.join(SHM_DIR, glob.escape(name) + "-*"))
    return sorted(paths, key=lambda p: int(p.rpartition("-")[2]))


def remove_pools(name: str) -> None:
    for path in pool_paths(name):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def map_pool(path: str, dtype: torch.dtype) -> torch.Tensor:
    """A pool file as a flat tensor of `dtype`, mapped shared: what one process writes, the other reads. (Mapped
    writable by a reader too: torch.frombuffer takes no read-only buffer; a reader only ever copies out.)"""
    with open(path, "r+b") as f:
        buffer = mmap.mmap(f.fileno(), os.fstat(f.fileno()).st_size)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype)


class SharedPools:
    """A pool factory for ModelRunner (its `pool` argument): pool i is the file /dev/shm/NAME-i."""

    def __init__(self, name: str) -> None:
        if os.sep in name or not name:
            raise ValueError(f"kv_shared_memory must be a plain file name, got {name!r}")
        self.name = name
        self.count = 0

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if device.type != "cpu":
            raise ValueError(f"kv_shared_memory shares KV pools through host memory: device {device} is not the CPU")
        nbytes = math.prod(shape) * dtype.itemsize
        if self.count == 0:
            remove_pools(self.name)  # a dead engine's of the same name
            free = os.statvfs(SHM_DIR)
            if free.f_bavail * free.f_frsize < nbytes:
                raise ValueError(
                    f"{SHM_DIR} has {free.f_bavail * free.f_frsize / 2**30:.2f} GiB free, less than one KV pool "
                    f"({nbytes / 2**30:.2f} GiB): lower kv_cache_gb"
                )
        path = os.path.join(SHM_DIR, f"{self.name}-{self.count}")
        self.count += 1
        with open(path, "w+b") as f:
            f.truncate(nbytes)
        return map_pool(path, dtype).view(shape)
