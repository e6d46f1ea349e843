"""The float32 small-batch matmul kernel: BLAS's product to float32 rounding, and each row's floats independent of
the rows beside it (so that a verify step of k + 1 rows gives a decode step's logits bit for bit)."""

from __future__ import annotations

import pytest
import torch

from tokenloop import kernels

pytestmark = pytest.mark.skipif(not kernels.cpu_kernels_available(), reason="tokenloop's CPU kernels are not available here")


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, 17, 32])
@pytest.mark.parametrize("n, k", [(64, 576), (97, 1536), (1, 16), (7, 48)])
def test_equals_blas_and_every_row_is_the_same_alone(m, n, k):
    torch.manual_seed(m * n + k)
    x, w = torch.randn(m, k), torch.randn(n, k)
    y = torch.ops.tokenloop.f32_matmul(x, w)
    torch.testing.assert_close(y, x.double().mm(w.double().t()).float(), rtol=1e-5, atol=1e-4)
    for row in range(m):
        assert torch.equal(y[row], torch.ops.tokenloop.f32_matmul(x[row : row + 1], w)[0])


def test_more_rows_or_an_odd_k_go_to_blas():
    x, w = torch.randn(40, 576), torch.randn(16, 576)
    torch.testing.assert_close(torch.ops.tokenloop.f32_matmul(x, w), x @ w.t())
    x, w = torch.randn(3, 20), torch.randn(16, 20)
    torch.testing.assert_close(torch.ops.tokenloop.f32_matmul(x, w), x @ w.t())
