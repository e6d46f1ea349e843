"""Weights are advised into transparent huge pages where Linux has them: checked in the kernel's own view of the
mapping (/proc/self/smaps, VmFlags `hg`: MADV_HUGEPAGE was given for it)."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch
from torch import nn

from tokenloop.models.huge_pages import ALIGNMENT, HUGE_PAGE, advise_huge_pages, allocate_in_huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_thp = pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here"
)


def vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping of this process that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def huge_part(tensor: torch.Tensor) -> int:
    """The first address of the tensor's storage that starts a huge page."""
    return -(-tensor.untyped_storage().data_ptr() // HUGE_PAGE) * HUGE_PAGE


def fresh_mapping(nbytes: int) -> torch.Tensor:
    """A tensor on a new anonymous mapping: never advised before (memory from the allocator may be an area that an
    earlier test's model advised, and then the check before advising would read `hg` already)."""
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)


@needs_thp
def test_a_large_tensor_is_advised_and_a_small_one_is_left_alone():
    large, small = fresh_mapping(8 << 20), fresh_mapping(1 << 20)
    assert "hg" not in vm_flags(huge_part(large))
    assert advise_huge_pages([large, small]) >= 6 << 20  # at least three whole huge pages of 8 MiB, none of 1 MiB
    assert "hg" in vm_flags(huge_part(large))


def test_tensors_off_the_cpu_are_skipped():
    assert advise_huge_pages([torch.empty(8 << 20, dtype=torch.uint8, device="meta")]) == 0


@needs_thp
def test_small_tensors_share_one_advised_storage():
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(256, 256) for _ in range(40)))  # 256 KB a weight: no huge page alone
    model[1].weight = model[0].weight
    allocate_in_huge_pages(model, torch.device("cpu"))
    tensors = list({t.data_ptr(): t for t in model.parameters()}.values())  # the tied pair counted once
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    # nn.Module._apply gives the tied pair two Parameters, over one memory
    assert model[1].weight.data_ptr() == model[0].weight.data_ptr()
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in tensors)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])), "tensors overlap"
    assert all(start % ALIGNMENT == 0 for start, _ in spans)
    assert spans[0][0] % HUGE_PAGE == 0 and "hg" in vm_flags(spans[0][0])
    for i, t in enumerate(tensors):
        t.data.fill_(i)
    assert all(bool((t == i).all()) for i, t in enumerate(tensors))


def test_off_the_cpu_each_tensor_gets_its_own_memory():
    with torch.device("meta"):
        model = nn.Linear(8, 4)
    allocate_in_huge_pages(model, torch.device("meta"))
    assert model.weight.shape == (4, 8) and model.weight.device.type == "meta"


@needs_thp
def test_a_loaded_model_has_its_weights_advised(llm_fp32):
    model = llm_fp32.llm_engine.runner.model
    embedding = model.embed_tokens.weight  # 49,152 x 576 float32: 113 MB
    assert "hg" in vm_flags(huge_part(embedding))
    norm = model.layers[0].input_layernorm.weight  # 2 KB, in the same storage
    assert norm.untyped_storage().data_ptr() == embedding.untyped_storage().data_ptr()
    assert "hg" in vm_flags(norm.data_ptr())
