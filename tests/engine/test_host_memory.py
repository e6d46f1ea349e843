"""glibc keeps freed step-sized blocks mapped: after the first few steps, a block of that size faults no page in.

Not from the first free on: an aligned request asks for a little more than the block it freed, so where a small
allocation has landed just after that block the next one goes past it (about one process in three here); once two
have been freed side by side, the space holds the next. Checked in a process of its own, without other tests'
threads allocating in between."""

import subprocess
import sys

import pytest

CHECK = """
import resource, sys, torch
from tokenloop.engine.host_memory import keep_freed_memory

def minor_faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

if sys.argv[1] == "keep" and not keep_freed_memory():
    print("skip")
else:
    for _ in range(3):  # the first steps: allocated, touched and freed
        torch.ones(32, 262_144)  # Gemma 3's logits at 32 rows, 32 MiB
    before = minor_faults()
    again = torch.ones(32, 262_144)
    print(minor_faults() - before, again.numel() * again.element_size() // resource.getpagesize())
"""


def faults_of_a_later_block(settings: str) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", CHECK, settings], capture_output=True, text=True, check=True)
    if out.stdout.split() == ["skip"]:
        pytest.skip("the C library is not glibc")
    faults, pages = map(int, out.stdout.split())
    return faults, pages


def test_a_freed_logits_sized_block_is_reused_without_faulting_its_pages_in():
    faults, pages = faults_of_a_later_block("keep")
    assert faults < pages // 100, (faults, pages)


def test_without_the_settings_every_block_faults_its_pages_in_again():
    faults, pages = faults_of_a_later_block("default")
    assert faults >= pages, (faults, pages)
