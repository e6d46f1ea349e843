"""The model runner's step input: each sequence's new tokens attend as one entry (its rows, first position, block
table), whatever mix of prompt chunks and decodes the step carries; a sliding-window layer sees the same entries
with its window; the SDPA path (where the kernel cannot run) gives the kernel's attention; logit rows are asked per
sequence (the last one to sample, every prompt position to score)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import quantized_activations
from tokenloop.engine.model_runner import ModelRunner
from tokenloop.engine.scheduler import ScheduledBatch
from tokenloop.engine.sequence import Sequence
from tokenloop.models import kv_layout
from tokenloop.models.loader import load_model
from tokenloop.sampling.params import SamplingParams


def test_each_sequence_attends_as_one_entry_whatever_its_phase(tiny_model_folder):
    loaded = load_model(tiny_model_folder, torch.float32, torch.device("cpu"), load_tokenizer=False)
    runner = ModelRunner(
        loaded.model, loaded.config, num_blocks=8, block_size=16, kv_dtype=torch.float32, device=torch.device("cpu")
    )
    decoding = Sequence("a", [5, 6, 7, 8, 9, 10], 5, SamplingParams(), num_computed_tokens=5, block_tables=[[0, 1]])
    prompt = Sequence("b", [11, 12, 13, 14, 15], 5, SamplingParams(), num_computed_tokens=1, block_tables=[[2, 3]])
    other = Sequence("c", [1, 2, 3], 2, SamplingParams(), num_computed_tokens=2, block_tables=[[4]])
    inp = runner.prepare(ScheduledBatch([decoding, prompt, other], [1, 4, 1]))

    assert not inp.decode_only
    assert inp.positions.tolist() == [5, 1, 2, 3, 4, 2]
    assert inp.meta.slot_mapping.tolist() == [[5, 33, 34, 35, 36, 66]]  # one KV cache group
    meta = inp.meta
    assert (
        meta.query_start.tolist() == [0, 1, 5]
        and meta.query_count.tolist() == [1, 4, 1]
        and meta.first_position.tolist() == [5, 1, 2]
    )
    assert meta.block_tables.tolist() == [[[0, 1], [2, 3], [4, 0]]] and meta.block_size == 16  # padding blocks: 0
    assert inp.sample_seq_indices == [0, 1, 2] and inp.logit_rows.tolist() == [0, 4, 5]
    assert meta.windowed(3).window == 3 and meta.window is None
    assert runner.prepare(ScheduledBatch([decoding, other], [1, 1])).decode_only


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8])
@pytest.mark.parametrize("window", [None, 3])
def test_the_sdpa_path_gives_the_kernels_attention(tiny_model_folder, window, kv_dtype):
    """Where the kernel cannot run (a GPU), SDPA over a gathered copy attends to the same keys: decodes, a chunk
    after cached tokens and a prompt from its first token, in one step, full and windowed, from a float32 cache
    and from an int8 one (dequantized as gathered)."""
    loaded = load_model(tiny_model_folder, torch.float32, torch.device("cpu"), load_tokenizer=False)
    runner = ModelRunner(
        loaded.model, loaded.config, num_blocks=8, block_size=16, kv_dtype=kv_dtype, device=torch.device("cpu")
    )
    attn = loaded.model.attention_layers()[0]
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randn(attn.num_kv_heads, 8 * 16, attn.head_dim, generator=gen) for _ in range(2)]
    for cache, filled in zip((attn.k_cache, attn.v_cache), kv_layout.from_rows(*rows, 16, kv_dtype)):
        cache.copy_(filled)
    decoding = Sequence("a", [5, 6, 7, 8, 9, 10], 5, SamplingParams(), num_computed_tokens=5, block_tables=[[0, 1]])
    long = Sequence("c", list(range(20, 27)), 7, SamplingParams(), num_computed_tokens=2, block_tables=[[2, 3]])
    fresh = Sequence("d", [11, 12, 13, 14, 15], 5, SamplingParams(), block_tables=[[5, 6]])
    meta = runner.prepare(ScheduledBatch([decoding, long, fresh], [1, 5, 2])).meta
    meta = meta if window is None else meta.windowed(window)
    q = torch.randn(8, attn.num_heads, attn.head_dim, generator=gen)
    if kv_dtype == torch.int8:  # queries the int8 kernel's rounding keeps as they are
        q = quantized_activations(q, block=attn.head_dim).float()
    kernel = attn.attend(q, meta)
    attn.cpu_kernel = False
    try:
        # the int8 kernel rounds probabilities to int16: within about 1e-4 of the floats
        tolerance = 1e-5 if kv_dtype == torch.float32 else 5e-4
        torch.testing.assert_close(attn.attend(q, meta), kernel, atol=tolerance, rtol=tolerance)
    finally:
        attn.cpu_kernel = True


def test_a_scored_prompt_asks_for_the_logits_of_each_position_and_its_last_row_samples(tiny_model_folder):
    loaded = load_model(tiny_model_folder, torch.float32, torch.device("cpu"), load_tokenizer=False)
    runner = ModelRunner(
        loaded.model, loaded.config, num_blocks=8, block_size=16, kv_dtype=torch.float32, device=torch.device("cpu")
    )
    decoding = Sequence("a", [5, 6, 7, 8, 9, 10], 5, SamplingParams(), num_computed_tokens=5, block_tables=[[0, 1]])
    scored = Sequence(
        "b", [11, 12, 13, 14, 15, 16], 6, SamplingParams(prompt_logprobs=2), block_tables=[[2, 3]], score_prompt=True
    )
    first = runner.prepare(ScheduledBatch([decoding, scored], [1, 4]))  # a chunk: positions 0..3 score tokens 1..4
    assert [(s.seq_index, s.start, s.first_position, s.count, s.samples) for s in first.spans] == [
        (0, 0, 5, 1, True),
        (1, 1, 0, 4, False),
    ]
    assert first.logit_rows.tolist() == [0, 1, 2, 3, 4] and first.sample_seq_indices == [0]

    logits = runner.logits(first)
    (scores,) = runner.score(logits, first, [decoding, scored])
    assert scores.seq_index == 1 and scores.first_position == 1 and scores.samples.token_ids == [12, 13, 14, 15]
    expected = logits[1:5].log_softmax(-1)
    torch.testing.assert_close(
        torch.tensor([row[0] for row in scores.samples.logprobs]), expected[range(4), [12, 13, 14, 15]]
    )
    assert all(len(row) == 3 for row in scores.samples.logprobs)  # the token's own, then the top 2
    torch.testing.assert_close(runner.sample_logits(logits, first), logits[:1])

    scored.num_computed_tokens = 4  # the last chunk: position 4 scores token 5, position 5 samples
    last = runner.prepare(ScheduledBatch([scored], [2]))
    assert [(s.first_position, s.count, s.samples, s.num_scored) for s in last.spans] == [(4, 2, True, 1)]
    assert runner.sample_logits(runner.logits(last), last).shape[0] == 1
