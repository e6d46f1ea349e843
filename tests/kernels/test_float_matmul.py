"""The float32 matmul kernel: float64's product to float32 rounding, and each row's floats independent of the rows
beside it, of the row count and of the thread count (so that a token's logits are the same decoded, verified, or
prefilled in a chunk of any size)."""

from __future__ import annotations

import pytest
import torch

from tokenloop import kernels

pytestmark = pytest.mark.skipif(
    not kernels.cpu_kernels_available(), reason="tokenloop's CPU kernels are not available here"
)

# N not a multiple of the kernel's column group (3 or 6 weight rows), K a multiple of its vector or not (8 or 16).
SHAPES = [(100, 576), (61, 200)]


def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.tokenloop.f32_matmul(x, w)


def assert_close_to_float64(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    torch.testing.assert_close(y, x.double().mm(w.double().t()).float(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, 17, 32])
@pytest.mark.parametrize("n, k", [(64, 576), (97, 1536), (1, 16), (7, 48), (16, 20), (5, 3)])
def test_close_to_float64_and_every_row_is_the_same_alone(m, n, k):
    torch.manual_seed(m * n + k)
    x, w = torch.randn(m, k), torch.randn(n, k)
    y = matmul(x, w)
    assert_close_to_float64(y, x, w)
    for row in range(m):
        assert torch.equal(y[row], matmul(x[row : row + 1], w)[0])


@pytest.mark.parametrize("m", [1, 7, 32, 33, 200, 1024])
@pytest.mark.parametrize("n, k", SHAPES)
def test_close_to_float64_for_any_row_count(m, n, k):
    torch.manual_seed(m + n + k)
    x, w = torch.randn(m, k), torch.randn(n, k)
    assert_close_to_float64(matmul(x, w), x, w)


@pytest.mark.parametrize("n, k", SHAPES)
def test_a_row_is_the_same_alone_in_any_batch_and_in_any_order(n, k):
    torch.manual_seed(n + k)
    x, w = torch.randn(100, k), torch.randn(n, k)
    y = matmul(x, w)
    alone = torch.cat([matmul(x[row : row + 1], w) for row in range(100)])
    assert torch.equal(y, alone)
    for start in (0, 30, 67):
        assert torch.equal(matmul(x[start : start + 33], w), y[start : start + 33])
    for seed in range(3):
        perm = torch.randperm(100, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(matmul(x[perm], w), y[perm])
        assert torch.equal(matmul(x[perm[:45]], w), y[perm[:45]])


@pytest.mark.parametrize("m", [1, 100, 1024])
def test_a_row_is_the_same_with_one_or_two_threads(m):
    torch.manual_seed(m)
    x, w = torch.randn(m, 576), torch.randn(1536, 576)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = matmul(x, w)
        torch.set_num_threads(2)
        two = matmul(x, w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert torch.equal(one[m // 2], matmul(x[m // 2 : m // 2 + 1], w)[0])


def test_strided_inputs_give_the_contiguous_floats():
    torch.manual_seed(0)
    x, w = torch.randn(576, 40), torch.randn(576, 64)
    assert torch.equal(matmul(x.t(), w.t()), matmul(x.t().contiguous(), w.t().contiguous()))


def test_empty_products():
    assert torch.equal(matmul(torch.randn(3, 0), torch.randn(5, 0)), torch.zeros(3, 5))
    assert matmul(torch.randn(0, 16), torch.randn(5, 16)).shape == (0, 5)
