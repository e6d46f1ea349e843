"""Each GGML type the fast path keeps quantized maps onto the kernel's int4, int5 or int8 form without changing one
weight (bit for bit against gguf's own dequantization), loads into its module in row blocks, and the kernel's
product equals the float64 product of the int8-quantized activations with those exact weights.

K-quant blocks are random bytes with finite float16 fields: every bit pattern of the integer fields is a valid
block, so this covers every scale, min and high bit, not only what a quantizer would write."""

from __future__ import annotations

import gguf
import pytest
import torch
from gguf.quants import dequantize

from tests.gguf_files import HALF_FIELDS, random_blocks
from tests.helpers import quantized_activations
from tokenloop import kernels
from tokenloop.models.ggml_types import GGML_FORMATS
from tokenloop.models.quant import FactoredScales, Int4Linear, Int8Embedding
from tokenloop.models.weights import QUANTIZED_LINEARS

Q = gguf.GGMLQuantizationType


def test_every_type_has_a_mapping_and_its_halves_listed():
    assert set(GGML_FORMATS) == set(HALF_FIELDS)


@pytest.mark.parametrize("qtype", list(GGML_FORMATS), ids=lambda q: q.name)
def test_the_mapping_reproduces_gguf_dequantization_bit_for_bit(qtype):
    rows, cols = 21, 512  # two K-quant super-blocks per row; 21 rows: two full groups of 8 and a padded one
    blocks = random_blocks(qtype, rows, cols, seed=int(qtype))
    expected = torch.from_numpy(dequantize(blocks, qtype))
    fmt = GGML_FORMATS[qtype]
    tensor = fmt.convert(blocks)
    assert tensor.shape == (rows, cols) and tensor.layout == fmt.layout.widened()  # Q5_0 comes as int8 in -16..15
    assert torch.equal(tensor.dequantize(), expected)
    module = QUANTIZED_LINEARS[fmt.layout.bits](cols, rows, False, fmt.layout)
    module.load_rows(slice(0, 13), tensor.rows(slice(0, 13)))  # 13 splits one of the kernel's 8-row groups
    module.load_rows(slice(13, rows), tensor.rows(slice(13, rows)))
    weight = module.weight_int4() if isinstance(module, Int4Linear) else module.weight_int8()
    assert torch.equal(weight.dequantize(), expected)


@pytest.mark.skipif(kernels._unsupported_reason() is not None, reason=str(kernels._unsupported_reason()))
@pytest.mark.parametrize("qtype", list(GGML_FORMATS), ids=lambda q: q.name)
@pytest.mark.parametrize("m", [1, 5, 40])
def test_the_kernel_is_the_int8_activation_product_with_the_exact_weights(qtype, m):
    rows, cols = 21, 512
    fmt = GGML_FORMATS[qtype]
    tensor = fmt.convert(random_blocks(qtype, rows, cols, seed=m))
    module = QUANTIZED_LINEARS[fmt.layout.bits](cols, rows, False, fmt.layout)
    module.load_rows(slice(None), tensor)
    module.use_cpu_kernel()
    assert module.cpu_kernel
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m)) * 3
    expected = quantized_activations(x) @ tensor.dequantize().double().t()
    torch.testing.assert_close(module(x).double(), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


def test_an_int8_embedding_with_a_scale_per_16_looks_up_exactly():
    tensor = GGML_FORMATS[Q.Q6_K].convert(random_blocks(Q.Q6_K, 30, 256, seed=3))
    embedding = Int8Embedding(30, 256, GGML_FORMATS[Q.Q6_K].layout)
    embedding.load_rows(slice(None), tensor)
    ids = torch.tensor([[3, 0], [29, 3]])
    assert torch.equal(embedding(ids), tensor.dequantize()[ids])


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_k_quant_scales_stay_the_files_integers_times_its_float16s(qtype):
    """d * sc needs up to 17 bits (Q4_K; 19 with Q6_K's int8): a float16 copy would round some. They stay factored,
    as in the file, and multiply out exactly in float32; the module holds them so, a fifth to a quarter of the bytes."""
    fmt = GGML_FORMATS[qtype]
    tensor = fmt.convert(random_blocks(qtype, 8, 512, seed=5))
    assert isinstance(tensor.scales, FactoredScales) and tensor.scales.per_256.dtype == torch.float16
    assert tensor.scales.dtype == fmt.layout.scale_dtype == (torch.uint8 if qtype == Q.Q4_K else torch.int8)
    products = tensor.scales.float()
    assert not torch.equal(products.half().float(), products)
    exact = tensor.scales.per_256.double().repeat_interleave(products.shape[1] // 2, dim=1) * tensor.scales.sub.double()
    assert torch.equal(products.double(), exact)
    module = QUANTIZED_LINEARS[fmt.layout.bits](512, 8, False, fmt.layout)
    assert module.scales.dtype == fmt.layout.scale_dtype and module.scales_per_256.dtype == torch.float16
