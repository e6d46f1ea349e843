"""tokenloop's sampling softmax kernels: each row's softmax at its temperature, whole (scaled_softmax) or for its k
most likely tokens (top_candidates), those in the order of a stable descending sort of x / t (equal values by
index, NaN first, as torch.sort ranks it), for any k, ties and all, with the whole distribution's own floats."""

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


ops = torch.ops.tokenloop
TEMPERATURE = torch.tensor([0.8, 1.0, 1.3, 0.05, 2.0, 1.0, 0.7, 1.0])


def candidates(x, t, rows, k):
    return ops.top_candidates(x, t, *ops.softmax_normalizers(x, t), rows, k)


@pytest.mark.parametrize("k", [1, 7, 33, 257, 2049, 3001])
def test_the_k_most_likely_in_the_stable_descending_order_with_the_distributions_floats(k):
    x, t = rows(), TEMPERATURE
    everything = torch.arange(len(x))
    probs, index = candidates(x, t, everything, k)
    expected = (x / t.unsqueeze(1)).argsort(dim=-1, descending=True, stable=True)[:, :k]
    assert torch.equal(index, expected)
    dense = ops.scaled_softmax(x, t, *ops.softmax_normalizers(x, t), everything)
    torch.testing.assert_close(probs, dense.gather(1, expected), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("k", [1, 33, 2049])
def test_values_whose_quotients_round_alike_or_overflow_keep_the_stable_order(k):
    """The scan rules values out by x before dividing: adjacent floats whose x / t round to one float (t = 0.9) tie
    and go by index, and values whose quotient overflows to inf (t = 0.05) tie at inf."""
    gen = torch.Generator().manual_seed(1)
    adjacent = (torch.tensor(1.9).view(torch.int32) + torch.arange(3001, dtype=torch.int32)).view(torch.float32)
    huge = (torch.tensor(3e38).view(torch.int32) - torch.arange(3001, dtype=torch.int32)).view(torch.float32)
    x = torch.stack([adjacent[torch.randperm(3001, generator=gen)], huge[torch.randperm(3001, generator=gen)]])
    t = torch.tensor([0.9, 0.05])
    _, index = candidates(x, t, torch.arange(2), k)
    assert torch.equal(index, (x / t.unsqueeze(1)).argsort(dim=-1, descending=True, stable=True)[:, :k])


def test_the_softmax_is_pytorchs_within_float_error_and_a_row_without_one_is_nan():
    x, t = rows(), TEMPERATURE
    dense = ops.scaled_softmax(x, t, *ops.softmax_normalizers(x, t), torch.arange(len(x)))
    expected = (x / t.unsqueeze(1)).softmax(dim=-1)
    finite = [0, 1, 2, 4, 5, 7]  # row 3 holds NaN, row 6 +inf: neither is a distribution
    torch.testing.assert_close(dense[finite], expected[finite], rtol=2e-6, atol=1e-9)
    assert dense[3].isnan().all() and dense[6].isnan().all()
    all_masked = torch.full((1, 40), float("-inf"))
    assert ops.softmax_normalizers(all_masked, torch.ones(1))[1].isnan().all()


def test_a_row_is_the_same_floats_alone_or_among_others():
    x, t = rows(), TEMPERATURE
    probs, index = candidates(x, t, torch.arange(len(x)), 40)
    some = torch.tensor([5, 0, 2])
    alone = candidates(x, t, some, 40)
    assert torch.equal(alone[1], index[some]) and torch.equal(alone[0], probs[some])
    one = candidates(x[2:3].contiguous(), t[2:3].contiguous(), torch.arange(1), 40)
    assert torch.equal(one[0], probs[2:3]) and torch.equal(one[1], index[2:3])


def test_bad_inputs_raise_a_clear_error():
    x, t = torch.randn(2, 5), torch.ones(2)
    with pytest.raises(RuntimeError, match="k must be in"):
        candidates(x, t, torch.arange(2), 6)
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.softmax_normalizers(x.double(), t)
    with pytest.raises(RuntimeError, match="temperature must be"):
        ops.softmax_normalizers(x, torch.ones(3))
    with pytest.raises(RuntimeError, match=r"rows must be in \[0, 2\), got 2"):
        candidates(x, t, torch.tensor([0, 2]), 3)
