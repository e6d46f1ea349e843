"""glibc keeps a freed step-sized block mapped: the next block of that size faults no page in."""

import resource

import pytest
import torch

from tokenloop.engine.host_memory import keep_freed_memory

LOGITS = (32, 262_144)  # Gemma 3's logits at 32 rows: 32 MiB, where glibc would map each one afresh


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_a_freed_logits_sized_block_is_reused_without_faulting_its_pages_in():
    if not keep_freed_memory():
        pytest.skip("the C library is not glibc")
    torch.ones(LOGITS)  # allocated, touched and freed: its pages stay with the process
    before = minor_faults()
    again = torch.ones(LOGITS)
    pages = again.numel() * again.element_size() // resource.getpagesize()
    assert minor_faults() - before < pages // 100, (minor_faults() - before, pages)
