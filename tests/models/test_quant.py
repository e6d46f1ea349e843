"""The fast path's quantized modules: the kernel where it can run, float32 on the exact weights otherwise, and a
model loaded with them (dtype "auto") stays close to the exact float32 path. (The mappings of each GGML type:
test_ggml_types.py.)"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.quants import dequantize, quantize

from tests.gguf_files import TOKENS, write_gguf
from tests.helpers import forward_in_chunks
from tokenloop import kernels
from tokenloop.models.ggml_types import GGML_FORMATS
from tokenloop.models.loader import load_model
from tokenloop.models.quant import Int4Linear, Int5Linear, Int8Embedding, Int8Tensor

Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize("cpu_kernel", [True, False])
def test_quantized_modules_run_the_kernel_where_it_can_and_float32_otherwise(cpu_kernel):
    torch.manual_seed(0)
    rng = np.random.default_rng(1)
    blocks = quantize(rng.standard_normal((64, 96)).astype(np.float32), Q.Q4_1)
    linear = Int4Linear(96, 64, bias=True)
    linear.load_rows(slice(None), GGML_FORMATS[Q.Q4_1].convert(blocks))
    torch.nn.init.normal_(linear.bias)
    head_blocks = quantize(rng.standard_normal((80, 96)).astype(np.float32), Q.Q8_0)
    head = Int8Embedding(80, 96)
    head.load_rows(slice(None), GGML_FORMATS[Q.Q8_0].convert(head_blocks))
    if cpu_kernel:
        linear.use_cpu_kernel()
        head.use_cpu_kernel()
        assert linear.cpu_kernel == head.cpu_kernel == (kernels._unsupported_reason() is None)
    weight = torch.from_numpy(dequantize(blocks, Q.Q4_1))
    head_weight = torch.from_numpy(dequantize(head_blocks, Q.Q8_0))
    x = torch.randn(70, 96)
    expected, expected_logits = F.linear(x, weight, linear.bias), F.linear(x, head_weight)
    if linear.cpu_kernel:  # int8 activations in the kernel: close to the float32 product (outputs ~10), not equal
        assert expected.abs().max() > 5
        torch.testing.assert_close(linear(x), expected, atol=0.25, rtol=0.02)
        torch.testing.assert_close(head.logits(x), expected_logits, atol=0.25, rtol=0.02)
    else:  # dense float32 on the exact weights
        assert torch.equal(linear(x), expected)
        torch.testing.assert_close(head.logits(x), expected_logits)
    rows = torch.tensor([0, 3, 4, 9, 17, 40, 41, 79, 12])  # a draft vocabulary's slice: the same rows' products
    part, whole = head.select_rows(rows)(x), head.logits(x)[:, rows]
    if head.cpu_kernel:  # each row's product alone: the very floats
        assert torch.equal(part, whole)
    else:  # BLAS may sum in another order for another shape
        torch.testing.assert_close(part, whole)


@pytest.mark.parametrize(
    "qtype,cls",
    [(Q.Q4_0, Int4Linear), (Q.Q4_1, Int4Linear), (Q.Q5_0, Int5Linear)],
    ids=lambda v: getattr(v, "name", None) or v.__name__,
)
def test_fast_path_keeps_gguf_4_and_5_bit_linears_and_stays_close_to_float32(tiny_model, tmp_path, qtype, cls):  # noqa: F811
    arch, model = tiny_model
    path = write_gguf(model, arch, tmp_path / "m.gguf", qtype)
    exact = load_model(path, torch.float32, torch.device("cpu"), load_tokenizer=False)
    fast = load_model(path, torch.float32, torch.device("cpu"), load_tokenizer=False, keep_quantized=True)
    held = [m for m in fast.model.modules() if isinstance(m, cls)]
    assert len(held) == 4 * len(fast.model.layers)  # qkv, o, gate_up, down in every layer
    weight = lambda linear: linear.weight_int4() if cls is Int4Linear else linear.weight_int8()  # noqa: E731
    for layer_exact, layer_fast in zip(exact.model.layers, fast.model.layers):
        assert torch.equal(weight(layer_fast.self_attn.qkv_proj).dequantize(), layer_exact.self_attn.qkv_proj.weight)
        assert torch.equal(weight(layer_fast.mlp.gate_up_proj).dequantize(), layer_exact.mlp.gate_up_proj.weight)
    # A tied Q5_0 embedding is the LM head read as int8 (exact: there is no 5-bit embedding form); a 4-bit one is not.
    tied_int8 = fast.config.tie_word_embeddings and qtype == Q.Q5_0
    assert isinstance(fast.model.embed_tokens, Int8Embedding) == tied_int8
    if tied_int8:
        assert fast.model.lm_head is fast.model.embed_tokens
        assert torch.equal(fast.model.embed_tokens.weight_int8().dequantize(), exact.model.embed_tokens.weight)
    # The kernel (int8 activations) where it runs, dense float32 on the same weights otherwise; whole prompt at
    # once (prefill) or one token at a time (decode).
    expected = forward_in_chunks(exact, TOKENS, [len(TOKENS)])
    for chunks in ([len(TOKENS)], [1] * len(TOKENS)):
        torch.testing.assert_close(forward_in_chunks(fast, TOKENS, chunks), expected, atol=0.05, rtol=0)


def test_fast_path_keeps_a_tied_q8_0_embedding_as_the_int8_lm_head(tiny_model, tmp_path):  # noqa: F811
    arch, model = tiny_model
    path = write_gguf(model, arch, tmp_path / "m.gguf", Q.Q8_0)
    exact = load_model(path, torch.float32, torch.device("cpu"), load_tokenizer=False)
    fast = load_model(path, torch.float32, torch.device("cpu"), load_tokenizer=False, keep_quantized=True)
    tied = fast.config.tie_word_embeddings
    assert isinstance(fast.model.embed_tokens, Int8Embedding) == tied
    if tied:
        assert fast.model.lm_head is fast.model.embed_tokens
        assert torch.equal(fast.model.embed_tokens.weight_int8().dequantize(), exact.model.embed_tokens.weight)
    expected = forward_in_chunks(exact, TOKENS, [len(TOKENS)])
    torch.testing.assert_close(forward_in_chunks(fast, TOKENS, [1] * len(TOKENS)), expected, atol=0.05, rtol=0)


def test_int5_linear_refuses_weights_outside_five_bits():
    linear = Int5Linear(32, 8, bias=False)
    q = torch.zeros(8, 32, dtype=torch.int8)
    q[3, 7] = 16
    with pytest.raises(ValueError, match=r"Int5Linear holds weights in -16\.\.15, got 0\.\.16"):
        linear.load_rows(slice(None), Int8Tensor(q, torch.ones(8, 1, dtype=torch.float16)))
