"""tokenloop's top_candidates kernel: each row's k largest values in the order of a stable descending sort (equal
values by index, NaN first, as torch.sort ranks it), for any k, ties and all."""

from __future__ import annotations

import pytest
import torch

from tokenloop import kernels

pytestmark = pytest.mark.skipif(kernels._unsupported_reason() is not None, reason=str(kernels._unsupported_reason()))


@pytest.fixture(scope="module", autouse=True)
def built():
    assert kernels.cpu_kernels_available()


def rows() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 3001, generator=gen)
    x[1, 100:400] = 2.5  # a run of ties inside and across the edge of k
    x[2] = 1.0  # a row of one value
    x[3, [7, 900, 1500]] = float("nan")
    x[4, ::2] = 0.0
    x[4, 1::2] = -0.0  # zeros of both signs are equal
    x[5] = (x[5] * 4).round()  # few distinct values
    x[6, -5:] = float("inf")
    x[7, :10] = float("-inf")
    return x


@pytest.mark.parametrize("k", [1, 7, 33, 257, 2049, 3001])
def test_the_k_largest_in_the_stable_descending_order(k):
    x = rows()
    values, index = torch.ops.tokenloop.top_candidates(x, k)
    expected = x.argsort(dim=-1, descending=True, stable=True)[:, :k]
    assert torch.equal(index, expected)
    torch.testing.assert_close(values, x.gather(1, expected), rtol=0, atol=0, equal_nan=True)


def test_bad_inputs_raise_a_clear_error():
    with pytest.raises(RuntimeError, match="k must be in"):
        torch.ops.tokenloop.top_candidates(torch.randn(2, 5), 6)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.tokenloop.top_candidates(torch.randn(2, 5).double(), 2)
