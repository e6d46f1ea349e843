"""Weights in 2 MiB pages where the kernel gives them.

A decode step streams every weight once: a 270M model's ~250 MB touch 60,000 4 KiB pages, about twenty times
what the TLB holds, so nearly every page costs a page walk, and the hardware prefetchers stop at each page's end.
Linux backs memory with transparent huge pages only where asked (`enabled` is `madvise` on most distributions):
this asks for the weights, before they are first written, so that they are faulted in as 2 MiB pages. A layer's
weights are a few hundred KB each, too small to hold a whole huge page of their own: all of a model's tensors
share one storage, and the step's stream crosses a page boundary every 2 MiB.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Iterable
from functools import cache

import torch
from torch import nn

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux
ALIGNMENT = 64  # a cache line: where the allocator would have put each tensor


@cache
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


def advise_huge_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Ask for huge pages under the 2 MiB-aligned part of each CPU tensor's storage (a smaller one holds no
    whole huge page). Returns the bytes advised; 0 where the system has no such advice (not Linux, or a kernel
    without transparent huge pages: the tensors are then as they were)."""
    madvise = _madvise()
    if madvise is None:
        return 0
    advised = 0
    for tensor in tensors:
        if tensor.device.type != "cpu":
            continue
        storage = tensor.untyped_storage()
        start = -(-storage.data_ptr() // HUGE_PAGE) * HUGE_PAGE
        end = (storage.data_ptr() + storage.nbytes()) // HUGE_PAGE * HUGE_PAGE
        if end > start and madvise(start, end - start, MADV_HUGEPAGE) == 0:
            advised += end - start
    return advised


def _aligned(t: torch.Tensor) -> int:
    return -(-t.nbytes // ALIGNMENT) * ALIGNMENT


def allocate_in_huge_pages(module: nn.Module, device: torch.device) -> None:
    """Give every parameter and buffer of `module` (built on the meta device) uninitialised memory on `device`: on
    the CPU, views into one storage advised for huge pages before anything is written to it (allocated one by
    one, only the embedding and the LM head would hold whole huge pages)."""
    if device.type != "cpu":
        # model.to_empty, but by a factory function: empty_like on a meta tensor runs a Python reference that
        # imports sympy (32 MB resident for nothing).
        module._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
        return
    tensors = {id(t): t for t in (*module.parameters(), *module.buffers())}
    arena = torch.empty(sum(map(_aligned, tensors.values())) + HUGE_PAGE, dtype=torch.uint8)
    advise_huge_pages([arena])
    offset = -arena.data_ptr() % HUGE_PAGE  # the first tensor starts a huge page
    placed: dict[int, torch.Tensor] = {}

    def place(t: torch.Tensor) -> torch.Tensor:
        nonlocal offset
        if id(t) not in placed:
            placed[id(t)] = arena[offset : offset + t.nbytes].view(t.dtype).view(t.shape)
            offset += _aligned(t)
        return placed[id(t)]

    module._apply(place)
