"""The attention kernel gives the same floats on any x86-64 CPU with AVX2: its float32 products on 16-lane vectors
(AVX-512) equal those on 8-lane ones, and an int8 cache's integer sums by AVX512-VNNI equal a plain loop's. The
library built with the AVX2 flags only (as on a CPU without AVX-512) runs in a child process, beside this one's."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tokenloop import kernels
from tokenloop.models import kv_layout

pytestmark = [
    pytest.mark.slow,  # builds the library once more (about 30 s on 2 cores)
    pytest.mark.skipif(kernels._unsupported_reason() is not None, reason=str(kernels._unsupported_reason())),
]

CHILD = """
import sys, torch
torch.ops.load_library(sys.argv[1])
inputs = torch.load(sys.argv[2])
torch.save([torch.ops.tokenloop.paged_attention(*args) for args in inputs], sys.argv[3])
"""


def attention_inputs() -> list[tuple]:
    gen = torch.Generator().manual_seed(0)
    inputs = []
    for dtype in (torch.int8, torch.float32, torch.float16):
        for d, heads, kv_heads in [(64, 9, 3), (256, 4, 1), (16, 4, 2)]:
            keys, values = (torch.randn(kv_heads, 16 * 12, d, generator=gen) * 3 for _ in range(2))
            k, v = kv_layout.from_rows(keys, values, 16, dtype)
            table = torch.randperm(12, generator=gen).view(1, 12)
            q = torch.randn(40, heads, d, generator=gen)
            one = torch.tensor([0]), torch.tensor([40]), torch.tensor([150])
            inputs.append((q, k, v, table, 16, *one, 0, d**-0.5))
    return inputs


def test_the_avx2_build_gives_the_floats_of_this_one(tmp_path):
    if not torch.cpu._is_avx512_supported():
        pytest.skip("this CPU has no AVX-512: its build is the AVX2 one")
    assert kernels.cpu_kernels_available()
    library = tmp_path / "avx2.so"
    kernels.build_library(kernels.CXX_FLAGS, library)
    inputs = attention_inputs()
    torch.save(inputs, tmp_path / "inputs.pt")
    child = [sys.executable, "-c", CHILD, str(library), str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt")]
    subprocess.run(child, check=True, capture_output=True)
    theirs = torch.load(tmp_path / "out.pt")
    ours = [torch.ops.tokenloop.paged_attention(*args) for args in inputs]
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
