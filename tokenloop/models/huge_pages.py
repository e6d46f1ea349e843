"""Weights in 2 MiB pages where the kernel gives them.

A decode step streams every weight once: a 270M model's ~250 MB touch 60,000 4 KiB pages, about twenty times
what the TLB holds, so nearly every page costs a page walk, and the hardware prefetchers stop at each page's end.
Linux backs memory with transparent huge pages only where asked (`enabled` is `madvise` on most distributions):
this asks for the weights, before they are first written, so that they are faulted in as 2 MiB pages.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Iterable
from functools import cache

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux


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
