"""Threads for the work that comes before a request is queued, at a lower CPU priority than the step.

Tokenizing runs in Rust without the GIL (tokenizer/tokenizer.py), so a long prompt on one of these threads stalls
neither the event loop nor the step thread; at a lower priority it takes a core only when the step leaves one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
# The lowest: at any higher one, a thread tokenizing a long prompt still took a core from the step's threads for
# long enough, now and then, to stall a step tenfold.
NICENESS = 19
logger = logging.getLogger(__name__)


def _lower_priority() -> None:
    """On Linux a thread has a nice value of its own (setpriority(2) on its thread id)."""
    try:
        current = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), max(current, NICENESS))
    except (AttributeError, OSError) as e:  # another OS, or not allowed: the same priority as the rest
        logger.debug("input threads keep their priority: %s", e)


class InputThreads:
    def __init__(self, workers: int = 2) -> None:
        # Two: a long prompt being tokenized does not hold up the short ones that arrive meanwhile.
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="tokenloop-input", initializer=_lower_priority)
        self._lock = threading.Lock()
        # Input work under way: jobs submitted and not done, and what else begin() counts (the server's requests
        # from their arrival); the step lends it a core meanwhile.
        self.busy = 0

    def begin(self) -> None:
        with self._lock:
            self.busy += 1

    def end(self, _: Future | None = None) -> None:
        with self._lock:
            self.busy -= 1

    def submit(self, fn: Callable[..., T], *args) -> Future[T]:
        self.begin()
        future = self._pool.submit(fn, *args)
        future.add_done_callback(self.end)
        return future

    async def run(self, fn: Callable[..., T], *args) -> T:
        return await asyncio.wrap_future(self.submit(fn, *args))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
