"""tokenloop's RMSNorm kernel stands in for RMSNorm's eager ops on eager float32 steps: the same floats but for the
order of each row's sum of squares, on every row (one parallel chunk or several), with D not a multiple of 8."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenloop import kernels
from tokenloop.models.layers import RMSNorm

pytestmark = pytest.mark.skipif(kernels._unsupported_reason() is not None, reason=str(kernels._unsupported_reason()))


@pytest.mark.parametrize("tokens,dim", [(1, 640), (37, 576), (300, 13)])
def test_matches_the_eager_ops_on_every_row(tokens, dim):
    gen = torch.Generator().manual_seed(dim)
    x, weight = 5 * torch.randn(tokens, dim, generator=gen), torch.randn(dim, generator=gen)
    out = torch.ops.tokenloop.rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(out, weight * F.rms_norm(x, (dim,), eps=1e-6), rtol=1e-6, atol=1e-5)


def test_rmsnorm_runs_it_on_eager_float32_rows_only(monkeypatch):
    calls = []
    kernel = torch.ops.tokenloop.rms_norm
    monkeypatch.setattr(torch.ops.tokenloop, "rms_norm", lambda *args: calls.append(args[0].shape) or kernel(*args))
    norm = RMSNorm(64, 1e-5)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(9, 64)
    torch.testing.assert_close(norm(x), norm.weight * F.rms_norm(x, (64,), eps=1e-5), rtol=1e-6, atol=1e-6)
    assert calls == [(9, 64)]
    norm(x.to(torch.bfloat16)), norm(x.view(3, 3, 64))  # other dtypes and shapes: the eager ops
    assert calls == [(9, 64)]


def test_bad_inputs_raise_a_clear_error():
    with pytest.raises(RuntimeError, match="x must be"):
        torch.ops.tokenloop.rms_norm(torch.randn(2, 3, 8), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="weight must be"):
        torch.ops.tokenloop.rms_norm(torch.randn(2, 8), torch.ones(7), 1e-6)
