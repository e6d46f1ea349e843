"""Keep the step's big host buffers mapped: glibc's malloc settings for a process that decodes on the CPU.

Each step allocates tensors of the same sizes again: its logits [rows, vocabulary] (Gemma 3's 262k columns: 33 MiB
at 32 rows), the sampler's scaled logits and distribution. glibc serves a block of 32 MiB or more by mmap and
unmaps it when freed (and trims a freed heap top), so the next step's block of the same size faults every page in
again and the kernel zeroes it: a division over 32 x 262k floats took 11 ms instead of 1.6. Serving such blocks
from the heap, and keeping what is freed there, makes the next step reuse the same pages, as the caching
allocators PyTorch recommends for the CPU (jemalloc, tcmalloc) do. Peak memory is what the busiest step needs, as
before; between steps the process keeps it instead of giving it back.

Kept, freed memory is reused only by the arena that freed it, and glibc gives each thread that allocates an arena of
its own: a server's step thread, its event loop and its input threads each held tens of MiB that the others could
not use. One arena for the process shares it; its lock is uncontended with a thread per core.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # mallopt's parameters (malloc.h)
KEEP_BYTES = 1 << 30  # blocks below this come from the heap; a heap top below it stays mapped


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds to KEEP_BYTES and its arenas to one, for the whole process. False (and
    nothing changed) where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    if not (
        mallopt(M_MMAP_THRESHOLD, KEEP_BYTES) and mallopt(M_TRIM_THRESHOLD, KEEP_BYTES) and mallopt(M_ARENA_MAX, 1)
    ):
        logger.info("the C library refused malloc's settings: large host buffers are mapped afresh each step")
        return False
    libc.malloc_trim(0)  # what loading freed inside the heap goes back now: from here on nothing is trimmed
    return True
