"""Keep the step's big host buffers mapped: glibc's malloc settings for a process that decodes on the CPU.

Each step allocates tensors of the same sizes again: its logits [rows, vocabulary] (Gemma 3's 262k columns: 33 MiB
at 32 rows), the sampler's scaled logits and distribution. glibc serves a block of 32 MiB or more by mmap and
unmaps it when freed (and trims a freed heap top), so the next step's block of the same size faults every page in
again and the kernel zeroes it: a division over 32 x 262k floats took 11 ms instead of 1.6. Serving such blocks
from the heap, and keeping what is freed there, makes the next step reuse the same pages, as the caching
allocators PyTorch recommends for the CPU (jemalloc, tcmalloc) do. Peak memory is what the busiest step needs, as
before; between steps the process keeps it instead of giving it back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
KEEP_BYTES = 1 << 30  # blocks below this come from the heap; a heap top below it stays mapped


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds to KEEP_BYTES, for the whole process. False (and nothing changed) where
    the C library is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    if not (mallopt(M_MMAP_THRESHOLD, KEEP_BYTES) and mallopt(M_TRIM_THRESHOLD, KEEP_BYTES)):
        logger.info("the C library refused malloc's thresholds: large host buffers are mapped afresh each step")
        return False
    return True
