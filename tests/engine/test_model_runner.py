"""The model runner's step input: a step that mixes decodes with a prefill chunk attends in two groups; a
sliding-window layer narrows their masks to its window; logit rows are asked per sequence (the last one to
sample, every prompt position to score)."""

from __future__ import annotations

import torch

from tokenloop.engine.model_runner import ModelRunner
from tokenloop.engine.scheduler import ScheduledBatch
from tokenloop.engine.sequence import Sequence
from tokenloop.models.attention import AttentionMetadata
from tokenloop.models.loader import load_model
from tokenloop.sampling.params import SamplingParams


def test_decodes_and_a_prefill_chunk_attend_in_separate_groups_decodes_first(tiny_model_folder):
    loaded = load_model(tiny_model_folder, torch.float32, torch.device("cpu"), load_tokenizer=False)
    runner = ModelRunner(loaded.model, loaded.config, num_blocks=8, block_size=4, kv_dtype=torch.float32, device=torch.device("cpu"))
    decoding = Sequence("a", [5, 6, 7, 8, 9, 10], 5, SamplingParams(), num_computed_tokens=5, block_table=[0, 1])
    prompt = Sequence("b", [11, 12, 13, 14, 15], 5, SamplingParams(), num_computed_tokens=1, block_table=[2, 3])
    other = Sequence("c", [1, 2, 3], 2, SamplingParams(), num_computed_tokens=2, block_table=[4])
    inp = runner.prepare(ScheduledBatch([decoding, prompt, other], [1, 4, 1]))

    assert not inp.decode_only
    assert inp.positions.tolist() == [5, 1, 2, 3, 4, 2]
    assert inp.meta.slot_mapping.tolist() == [5, 9, 10, 11, 12, 18]
    decodes, chunk = inp.meta.groups
    assert decodes.token_rows.tolist() == [0, 5] and decodes.query_index.tolist() == [[0], [5]]
    assert decodes.key_slots.tolist() == [[0, 1, 2, 3, 4, 5], [16, 17, 18, 19, 0, 1]]  # past its context: masked
    assert decodes.mask[:, 0, 0].tolist() == [[True] * 6, [True] * 3 + [False] * 3]
    assert chunk.token_rows.tolist() == [1, 2, 3, 4] and chunk.query_index.tolist() == [[1, 2, 3, 4]]
    assert chunk.mask[0, 0].tolist() == [[j <= i for j in range(5)] for i in range(1, 5)]
    assert chunk.key_slots.tolist() == [[8, 9, 10, 11, 12]]
    assert inp.sample_seq_indices == [0, 1, 2] and inp.logit_rows.tolist() == [0, 4, 5]

    # A prompt from its first token beside a decode: its group's mask is plain causal (None, for SDPA's is_causal).
    fresh = Sequence("d", [20, 21, 22], 3, SamplingParams(), block_table=[5])
    _, chunk = runner.prepare(ScheduledBatch([other, fresh], [1, 3])).meta.groups
    assert chunk.mask is None and chunk.token_rows.tolist() == [1, 2, 3] and chunk.key_slots.tolist() == [[20, 21, 22]]



def test_a_sliding_window_layer_sees_each_querys_last_positions_within_its_causal_mask(tiny_model_folder):
    loaded = load_model(tiny_model_folder, torch.float32, torch.device("cpu"), load_tokenizer=False)
    runner = ModelRunner(loaded.model, loaded.config, num_blocks=8, block_size=4, kv_dtype=torch.float32, device=torch.device("cpu"))
    decoding = Sequence("a", [5, 6, 7, 8, 9, 10], 5, SamplingParams(), num_computed_tokens=5, block_table=[0, 1])
    long = Sequence("c", list(range(20, 27)), 7, SamplingParams(), num_computed_tokens=2, block_table=[2, 3])
    fresh = Sequence("d", [11, 12, 13, 14, 15], 5, SamplingParams(), block_table=[5, 6])
    inp = runner.prepare(ScheduledBatch([decoding, long, fresh], [1, 5, 2]))
    decodes, chunks = inp.meta.windowed(3, inp.positions).groups
    assert decodes.mask[0, 0, 0].tolist() == [j in (3, 4, 5) for j in range(6)]  # the decode at position 5
    # Chunks at positions 2..6 and 0..1 (padded to 5 queries): keys i-2..i each.
    assert chunks.mask[0, 0].tolist() == [[i - 3 < j <= i for j in range(7)] for i in range(2, 7)]
    assert chunks.mask[1, 0, :2].tolist() == [[i - 3 < j <= i for j in range(7)] for i in range(2)]
    # Padding rows (dropped) look from another sequence's position and may find nothing in their window: they
    # keep key 0, so that no softmax row is empty.
    assert chunks.mask.any(dim=-1).all()

    # One prompt from its first token (plain causal for full layers, mask None) gets its window's mask.
    (alone,) = runner.prepare(ScheduledBatch([fresh], [5])).meta.groups
    assert alone.mask is None
    (windowed,) = AttentionMetadata(torch.zeros(5), [alone]).windowed(2, torch.arange(5)).groups
    assert windowed.mask[0, 0].tolist() == [[i - 2 < j <= i for j in range(5)] for i in range(5)]


def test_a_scored_prompt_asks_for_the_logits_of_each_position_and_its_last_row_samples(tiny_model_folder):
    loaded = load_model(tiny_model_folder, torch.float32, torch.device("cpu"), load_tokenizer=False)
    runner = ModelRunner(loaded.model, loaded.config, num_blocks=8, block_size=4, kv_dtype=torch.float32, device=torch.device("cpu"))
    decoding = Sequence("a", [5, 6, 7, 8, 9, 10], 5, SamplingParams(), num_computed_tokens=5, block_table=[0, 1])
    scored = Sequence("b", [11, 12, 13, 14, 15, 16], 6, SamplingParams(prompt_logprobs=2), block_table=[2, 3], score_prompt=True)
    first = runner.prepare(ScheduledBatch([decoding, scored], [1, 4]))  # a chunk: positions 0..3 score tokens 1..4
    assert [(s.seq_index, s.start, s.first_position, s.count, s.samples) for s in first.spans] == [(0, 0, 5, 1, True), (1, 1, 0, 4, False)]
    assert first.logit_rows.tolist() == [0, 1, 2, 3, 4] and first.sample_seq_indices == [0]

    logits = runner.logits(first)
    (scores,) = runner.score(logits, first, [decoding, scored])
    assert scores.seq_index == 1 and scores.first_position == 1 and scores.samples.token_ids == [12, 13, 14, 15]
    expected = logits[1:5].log_softmax(-1)
    torch.testing.assert_close(torch.tensor([row[0] for row in scores.samples.logprobs]), expected[range(4), [12, 13, 14, 15]])
    assert all(len(row) == 3 for row in scores.samples.logprobs)  # the token's own, then the top 2
    torch.testing.assert_close(runner.sample_logits(logits, first), logits[:1])

    scored.num_computed_tokens = 4  # the last chunk: position 4 scores token 5, position 5 samples
    last = runner.prepare(ScheduledBatch([scored], [2]))
    assert [(s.first_position, s.count, s.samples, s.num_scored) for s in last.spans] == [(4, 2, True, 1)]
    assert runner.sample_logits(runner.logits(last), last).shape[0] == 1
