"""tokenloop's CPU kernel for GGUF-quantized weights: int8 activations per block of 32, integer dot products.

Its result must be the product of the int8-quantized activations with the exact weights, computed in float64
with torch (equal up to float32 rounding), and close to the float32 product of the unquantized activations."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import quantized_activations
from tokenloop import kernels
from tokenloop.models.quant import (
    FactoredScales,
    Int4Linear,
    Int4Tensor,
    Int5Linear,
    Int8Embedding,
    Int8Linear,
    Int8Tensor,
    QuantLayout,
)

pytestmark = pytest.mark.skipif(kernels._unsupported_reason() is not None, reason=str(kernels._unsupported_reason()))


@pytest.fixture(scope="module", autouse=True)
def built():
    assert kernels.cpu_kernels_available()  # where it is supported, building it must work


def random_q4(n: int, k: int, gen: torch.Generator) -> tuple[Int4Linear, torch.Tensor]:
    """An Int4Linear (the kernel's interleaved layout, rows padded to a multiple of 8) and its exact weight."""
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    scale = (torch.rand(n, k // 32, generator=gen) * 0.02).half()  # float16, as GGUF stores them
    offset = (-torch.rand(n, k // 32, generator=gen) * 0.1).half()
    linear = Int4Linear(k, n, bias=False)
    linear.load_rows(slice(None), Int4Tensor(q, scale, offset))
    weight = (q.view(n, k // 32, 32).float() * scale.float()[..., None] + offset.float()[..., None]).view(n, k)
    return linear, weight


def q4_matmul(x: torch.Tensor, linear: Int4Linear) -> torch.Tensor:
    return torch.ops.tokenloop.q4_matmul(x, linear.qweight, linear.scales, linear.offsets)


# m activation rows (tiles of 4 and their remainders), k inputs, n outputs (8-row groups and padded ones)
SHAPES = [(1, 64, 32), (2, 96, 17), (3, 576, 100), (4, 64, 64), (5, 160, 33), (9, 1536, 48), (33, 96, 7), (130, 64, 24)]


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_q4_matmul_is_the_int8_activation_product(m, k, n):
    gen = torch.Generator().manual_seed(m * k + n)
    linear, weight = random_q4(n, k, gen)
    x = torch.randn(m, k, generator=gen) * 3
    x[0, :32] = 0  # an all-zero block has scale 0
    padded = q4_matmul(x, linear)
    assert padded.shape == (m, -(-n // 8) * 8) and not padded[:, n:].any()  # padding rows are zero
    y = padded[:, :n]
    expected = quantized_activations(x) @ weight.double().t()
    torch.testing.assert_close(y.double(), expected, atol=1e-5, rtol=1e-5)
    dense = x @ weight.t()
    assert (y - dense).abs().max() < 0.02 * dense.abs().max()


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_q8_matmul_is_the_int8_activation_product(m, k, n):
    gen = torch.Generator().manual_seed(m * k + n + 1)
    q = torch.randint(-128, 128, (n, k // 32, 32), dtype=torch.int8, generator=gen)
    q[0, 0, :4] = -128  # the most negative byte needs the sign trick to stay exact
    scale = (torch.rand(n, k // 32, generator=gen) * 0.02).half()
    head = Int8Embedding(n, k)  # the kernel's interleaved layout, rows padded to a multiple of 8
    head.load_rows(slice(None), Int8Tensor(q.view(n, k), scale))
    x = torch.randn(m, k, generator=gen)
    padded = torch.ops.tokenloop.q8_matmul(x, head.qweight, head.scales)
    assert padded.shape == (m, -(-n // 8) * 8) and not padded[:, n:].any()
    y = padded[:, :n]
    expected = quantized_activations(x) @ (q.double() * scale.double()[..., None]).view(n, k).t()
    torch.testing.assert_close(y.double(), expected, atol=1e-5, rtol=1e-5)


def random_q8(n: int, k: int, gen: torch.Generator, group: int = 32) -> Int8Linear:
    """An Int8Linear with random int8 weights (-128 included) and a scale per `group` weights."""
    linear = Int8Linear(k, n, bias=False, layout=QuantLayout(8, torch.float16 if group == 32 else torch.float32, group))
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    linear.load_rows(
        slice(None), Int8Tensor(q, (torch.rand(n, k // group, generator=gen) * 0.02).to(linear.layout.scale_dtype))
    )
    return linear


def random_q5(n: int, k: int, gen: torch.Generator) -> tuple[Int5Linear, Int8Linear]:
    """The same random weights in -16..15 (Q5_0's) held in 5 bits and as int8."""
    q = torch.randint(-16, 16, (n, k), dtype=torch.int8, generator=gen)
    q[0, :32] = torch.arange(-16, 16)  # every value, with its fifth bit
    weight = Int8Tensor(q, (torch.rand(n, k // 32, generator=gen) * 0.02).half())
    q5, q8 = Int5Linear(k, n, bias=False), Int8Linear(k, n, bias=False)
    q5.load_rows(slice(0, n // 2), weight.rows(slice(0, n // 2)))  # rows in two loads, as packed shards come
    q5.load_rows(slice(n // 2, n), weight.rows(slice(n // 2, n)))
    q8.load_rows(slice(None), weight)
    assert torch.equal(q5.weight_int8().q, q)
    return q5, q8


def q5_matmul(x: torch.Tensor, linear: Int5Linear) -> torch.Tensor:
    return torch.ops.tokenloop.q5_matmul(x, linear.qweight, linear.scales)


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_q5_matmul_gives_the_floats_of_the_same_weights_as_int8(m, k, n):
    """Below 12 rows the kernel unpacks each 5-bit weight as it streams in; from 12 on it widens them to q8's
    form first. Either way, the integer sums and floats of q8's kernel on the same weights."""
    gen = torch.Generator().manual_seed(m * k + n + 3)
    q5, q8 = random_q5(n, k, gen)
    x = torch.randn(m, k, generator=gen) * 3
    y = q5_matmul(x, q5)
    assert y.shape == (m, -(-n // 8) * 8) and not y[:, n:].any()
    assert torch.equal(y, torch.ops.tokenloop.q8_matmul(x, q8.qweight, q8.scales))


def factored(n: int, k: int, group: int, dtype: torch.dtype, gen: torch.Generator) -> FactoredScales:
    """K-quant scales: integers of `dtype` per `group` weights times a float16 per 256 (signs included)."""
    low, high = (0, 64) if dtype == torch.uint8 else (-128, 128)
    per_256 = (torch.rand(n, k // 256, generator=gen) * 0.02 - 0.01).half()
    return FactoredScales(torch.randint(low, high, (n, k // group), generator=gen).to(dtype), per_256)


@pytest.mark.parametrize("m", [1, 5, 13, 40])
@pytest.mark.parametrize("weights", ["q4", "q8 group 16"])
def test_factored_scales_give_the_floats_of_their_float32_products(weights, m):
    """The K-quants' scales stay the file's integers and float16s; multiplied in the kernel (exactly), they give
    the same products as float32 copies of d * sc, on 8 and 16 lanes, plain and gated."""
    gen = torch.Generator().manual_seed(m)
    n, k = 44, 512
    x, gate_up = torch.randn(m, k, generator=gen), torch.randn(m, 2 * k, generator=gen)
    if weights == "q4":
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
        scales, offsets = factored(n, k, 32, torch.uint8, gen), factored(n, k, 32, torch.uint8, gen)
        held = Int4Linear(k, n, bias=False, layout=QuantLayout(4, torch.uint8))
        held.load_rows(slice(None), Int4Tensor(q, scales, offsets))
        copy = Int4Linear(k, n, bias=False, layout=QuantLayout(4, torch.float32))
        copy.load_rows(slice(None), Int4Tensor(q, scales.float(), offsets.float()))
        assert torch.equal(held.weight_int4().dequantize(), copy.weight_int4().dequantize())
    else:
        q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
        scales = factored(n, k, 16, torch.int8, gen)
        held = Int8Linear(k, n, bias=False, layout=QuantLayout(8, torch.int8, 16))
        held.load_rows(slice(None), Int8Tensor(q, scales))
        copy = Int8Linear(k, n, bias=False, layout=QuantLayout(8, torch.float32, 16))
        copy.load_rows(slice(None), Int8Tensor(q, scales.float()))
        assert torch.equal(held.weight_int8().dequantize(), copy.weight_int8().dequantize())
    for module in (held, copy):
        module.use_cpu_kernel()
    assert held.scales.element_size() * 4 == copy.scales.element_size()
    assert torch.equal(held(x), copy(x))
    assert torch.equal(held.gated_forward(gate_up, "silu"), copy.gated_forward(gate_up, "silu"))


EXACT_ACTIVATIONS = {
    "silu": torch.nn.functional.silu,
    "gelu_pytorch_tanh": functools.partial(torch.nn.functional.gelu, approximate="tanh"),
}
# Controls: near misses the check must catch (a SiLU off by 1e-4 in its slope; GELU's erf form).
WRONG_ACTIVATIONS = {"silu": lambda g: g * torch.sigmoid(1.0001 * g), "gelu_pytorch_tanh": torch.nn.functional.gelu}


def relative_error(y: torch.Tensor, expected: torch.Tensor) -> float:
    return float((y - expected).norm() / expected.norm())


@pytest.mark.parametrize("activation", sorted(EXACT_ACTIVATIONS))
@pytest.mark.parametrize("weights", ["q4", "q5", "q8", "q8 group 16"])
@pytest.mark.parametrize("m,k,n", [(1, 64, 32), (5, 160, 33), (37, 1536, 64)])
def test_gated_matmul_is_the_matmul_of_act_gate_times_up(m, k, n, weights, activation):
    """A gated MLP's fused down projection takes act(gate) * up, its activation from a 20-ulp exp: the product of
    the activations computed in float64 to 1e-6 (measured: at most 1.5e-7), where a slightly wrong activation is
    off by 6.5e-6 or more."""
    gen = torch.Generator().manual_seed(m * k + n + 2)
    gate_up = torch.randn(m, 2 * k, generator=gen) * 3
    gate, up = gate_up.double().chunk(2, dim=-1)
    if weights == "q4":
        linear, _ = random_q4(n, k, gen)
        fused = torch.ops.tokenloop.q4_gated_matmul(gate_up, linear.qweight, linear.scales, linear.offsets, activation)

        def product(x):
            return q4_matmul(x, linear)

    elif weights == "q5":
        linear, _ = random_q5(n, k, gen)
        fused = torch.ops.tokenloop.q5_gated_matmul(gate_up, linear.qweight, linear.scales, activation)

        def product(x):
            return q5_matmul(x, linear)

    else:
        linear = random_q8(n, k, gen, group=16 if weights.endswith("16") else 32)
        fused = torch.ops.tokenloop.q8_gated_matmul(gate_up, linear.qweight, linear.scales, activation)

        def product(x):
            return torch.ops.tokenloop.q8_matmul(x, linear.qweight, linear.scales)

    assert relative_error(fused, product((EXACT_ACTIVATIONS[activation](gate) * up).float())) < 1e-6
    assert relative_error(fused, product((WRONG_ACTIVATIONS[activation](gate) * up).float())) > 1e-6


@pytest.mark.parametrize("weights", ["q4", "q5", "q8"])
def test_a_row_gets_the_same_floats_alone_and_among_many(weights):
    """A few rows run on 8 lanes, many on 16 (where built with AVX-512): a sequence's logits must not depend on
    how many others share its step. 33 rows: 16-lane tiles and a 1-row remainder; 7 output groups: an odd one."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(33, 256, generator=gen)
    if weights == "q4":
        linear, _ = random_q4(56, 256, gen)

        def product(rows):
            return q4_matmul(rows, linear)

    elif weights == "q5":
        linear, _ = random_q5(56, 256, gen)

        def product(rows):
            return q5_matmul(rows, linear)

    else:
        linear = random_q8(56, 256, gen, group=16)

        def product(rows):
            return torch.ops.tokenloop.q8_matmul(rows, linear.qweight, linear.scales)

    many = product(x)
    assert all(torch.equal(product(x[i : i + 1])[0], many[i]) for i in range(len(x)))


def test_bad_shapes_raise_a_clear_error():
    linear, _ = random_q4(8, 64, torch.Generator().manual_seed(0))
    packed, scale, offset = linear.qweight, linear.scales, linear.offsets
    with pytest.raises(RuntimeError, match="K must be a multiple of 32"):
        torch.ops.tokenloop.q4_matmul(torch.randn(1, 48), packed, scale, offset)
    with pytest.raises(RuntimeError, match=r"weight must be \[N / 8, K / 32, 128\] for K = 96"):
        torch.ops.tokenloop.q4_matmul(torch.randn(1, 96), packed, scale, offset)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.tokenloop.q4_matmul(torch.randn(1, 64).double(), packed, scale, offset)
    with pytest.raises(RuntimeError, match="offsets must be contiguous and of the scales' type"):
        torch.ops.tokenloop.q4_matmul(torch.randn(1, 64), packed, scale.float(), offset)
    with pytest.raises(RuntimeError, match="scales must be float16, float32, uint8 or int8"):
        torch.ops.tokenloop.q4_matmul(torch.randn(1, 64), packed, scale.double(), offset.double())
    with pytest.raises(RuntimeError, match=r"scales must be \[N / 8, K / 32, 8 or 16\]"):
        torch.ops.tokenloop.q8_matmul(
            torch.randn(1, 64), torch.zeros(1, 2, 256, dtype=torch.int8), torch.zeros(1, 2, 24).half()
        )
    with pytest.raises(RuntimeError, match="offsets must have shape"):
        torch.ops.tokenloop.q4_matmul(torch.randn(1, 64), packed, scale, offset[:, :1].contiguous())
    with pytest.raises(RuntimeError, match="K must be a multiple of 32, got 2K = 96"):
        torch.ops.tokenloop.q4_gated_matmul(torch.randn(1, 96), packed, scale, offset, "silu")
    with pytest.raises(RuntimeError, match="activation must be 'silu' or 'gelu_pytorch_tanh', got 'relu'"):
        torch.ops.tokenloop.q4_gated_matmul(torch.randn(1, 128), packed, scale, offset, "relu")
    with pytest.raises(RuntimeError, match="uint8 or int8 scales need their float16 factors per 256 weights"):
        torch.ops.tokenloop.q4_matmul(torch.randn(1, 64), packed, scale.to(torch.uint8), offset.to(torch.uint8))
    with pytest.raises(RuntimeError, match="float scales take no factors per 256 weights"):
        torch.ops.tokenloop.q8_matmul(
            torch.randn(1, 64),
            torch.zeros(1, 2, 256, dtype=torch.int8),
            torch.zeros(1, 2, 8).half(),
            torch.zeros(1, 1, 8).half(),
        )
    with pytest.raises(
        RuntimeError, match=r"factors per 256 weights must be a contiguous float16 \[N / 8, K / 256, 8\] tensor"
    ):
        torch.ops.tokenloop.q8_matmul(
            torch.randn(1, 256),
            torch.zeros(1, 8, 256, dtype=torch.int8),
            torch.zeros(1, 8, 8, dtype=torch.int8),
            torch.zeros(1, 2, 8).half(),
        )
    q4k_scales, q4k_factors = torch.zeros(1, 8, 8, dtype=torch.uint8), torch.zeros(1, 1, 8).half()
    with pytest.raises(
        RuntimeError,
        match=r"factors per 256 weights must be a contiguous float16 \[N / 8, K / 256, 8\] tensor, got \[1, 2, 8\]",
    ):
        torch.ops.tokenloop.q4_matmul(
            torch.randn(1, 256),
            torch.zeros(1, 8, 128, dtype=torch.uint8),
            q4k_scales,
            q4k_scales,
            q4k_factors,
            torch.zeros(1, 2, 8).half(),
        )
    with pytest.raises(RuntimeError, match="uint8 or int8 scales need their float16 factors per 256 weights"):
        torch.ops.tokenloop.q4_matmul(
            torch.randn(1, 256), torch.zeros(1, 8, 128, dtype=torch.uint8), q4k_scales, q4k_scales, q4k_factors
        )


def isa_outputs() -> list[torch.Tensor]:
    """The products on fixed random inputs (tiles of 1 to 4 rows, 4-, 5- and 8-bit weights)."""
    gen = torch.Generator().manual_seed(7)
    linear, _ = random_q4(40, 192, gen)
    x, gate_up = torch.randn(7, 192, generator=gen), torch.randn(7, 384, generator=gen)
    head = Int8Embedding(40, 192)
    head.load_rows(
        slice(None),
        Int8Tensor(
            torch.randint(-128, 128, (40, 192), dtype=torch.int8, generator=gen),
            torch.rand(40, 6, generator=gen).half(),
        ),
    )
    q6k = random_q8(40, 192, gen, group=16)
    q5, _ = random_q5(40, 192, gen)
    x13 = torch.randn(13, 192, generator=gen)  # from 12 rows, q5 is widened to q8 first
    q6k_held = Int8Linear(256, 24, bias=False, layout=QuantLayout(8, torch.int8, 16))  # the file's integer scales
    q6k_held.load_rows(
        slice(None),
        Int8Tensor(
            torch.randint(-128, 128, (24, 256), dtype=torch.int8, generator=gen), factored(24, 256, 16, torch.int8, gen)
        ),
    )
    x256 = torch.randn(5, 256, generator=gen)
    return [
        torch.ops.tokenloop.q8_matmul(x256, q6k_held.qweight, q6k_held.scales, q6k_held.scales_per_256),
        q5_matmul(x, q5),
        q5_matmul(x13, q5),
        torch.ops.tokenloop.q5_gated_matmul(gate_up, q5.qweight, q5.scales, "gelu_pytorch_tanh"),
        q4_matmul(x, linear),
        torch.ops.tokenloop.q4_gated_matmul(
            gate_up, linear.qweight, linear.scales, linear.offsets, "gelu_pytorch_tanh"
        ),
        torch.ops.tokenloop.q8_matmul(x, head.qweight, head.scales),
        torch.ops.tokenloop.q8_gated_matmul(gate_up, q6k.qweight, q6k.scales, "silu"),
    ]


@pytest.mark.skipif(
    kernels._cxx_flags() == kernels.CXX_FLAGS, reason="this CPU has no AVX512-VNNI: the AVX2 build is the only one"
)
def test_the_avx512_vnni_build_gives_the_avx2_builds_floats(tmp_path):
    # The AVX2 build runs in a child: one process can register the ops once.
    child = f"""
import sys, torch
sys.path.insert(0, {str(Path(__file__).parent)!r})
from tokenloop import kernels
kernels._cxx_flags = lambda: kernels.CXX_FLAGS
assert kernels.cpu_kernels_available()
import test_quantized_matmul
torch.save(test_quantized_matmul.isa_outputs(), {str(tmp_path / "avx2.pt")!r})
"""
    subprocess.run([sys.executable, "-c", child], check=True, capture_output=True)
    for avx2, vnni in zip(torch.load(tmp_path / "avx2.pt"), isa_outputs(), strict=True):
        assert torch.equal(avx2, vnni)
