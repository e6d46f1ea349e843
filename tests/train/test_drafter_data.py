"""A drafter's self-distilled data: the answers are the engine's own tokens, the recorded hidden states are those a
serial decode through the KV cache computes, the draft vocabulary is the most frequent answer tokens plus EOS, the
head's targets are shifted exactly, and the data saves, loads and batches the same way every time."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tests.helpers import forward_in_chunks
from tokenloop.models.loader import LoadedModel
from tokenloop.sampling.params import SamplingParams
from tokenloop.train.drafter_data import (
    DistillConfig,
    answer_token_counts,
    choose_draft_vocab,
    collect,
    coverage,
    held_out_coverage,
)
from tokenloop.train.drafter_dataset import DrafterData
from tokenloop.train.drafter_prompts import TOPICS, clean_request, seed_tasks
from tokenloop.train.packing import IGNORE_INDEX

PROMPTS = ("Hello world!", "The quick brown fox", "def main():", "I'm sure they'll say", "Numbers like 12345")


@pytest.fixture
def tiny(make_llm, tiny_model_folder):
    return make_llm(tiny_model_folder)


def distill(llm, **kw) -> DrafterData:
    return collect(llm, DistillConfig(**{"prompts": PROMPTS, "max_tokens": 12, "tokens_per_forward": 64} | kw), False)


def test_answers_are_the_engines_own_tokens(tiny):
    data = distill(tiny)
    prompts = [tiny.chat_prompt([{"role": "user", "content": p}]) for p in PROMPTS]
    outs = tiny.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert data.num_conversations == len(PROMPTS)
    for c, out in enumerate(outs):
        ids, hidden, answer_start = data.conversation(c)
        assert ids.tolist() == out.prompt_token_ids + list(out.outputs[0].token_ids)
        assert answer_start == len(out.prompt_token_ids)
        assert hidden.dtype == torch.float16 and hidden.shape == (len(ids), 64)
    assert data.info["prompts"] == list(PROMPTS)


def test_hidden_states_match_a_serial_decode_through_the_kv_cache(tiny):
    """Packed teacher forcing (several conversations per forward, cut at 64 tokens) against one token at a time."""
    data = distill(tiny, hidden_dtype="float32")
    engine = tiny.llm_engine
    loaded = LoadedModel(engine.runner.model, engine.model_config, engine.tokenizer, engine.config.model)
    for c in range(data.num_conversations):
        ids, hidden, _ = data.conversation(c)
        serial = forward_in_chunks(loaded, ids.tolist(), [1] * len(ids))
        with torch.inference_mode():
            recorded = loaded.model.compute_logits(hidden).float()
        torch.testing.assert_close(recorded, serial, atol=1e-4, rtol=0)


def test_draft_vocab_is_the_most_frequent_answer_tokens_plus_eos(tiny):
    eos = tiny.get_tokenizer().eos_token_ids
    data = distill(tiny, draft_vocab_size=6)
    answers = [data.conversation(c)[0][data.conversation(c)[2] :].tolist() for c in range(data.num_conversations)]
    counts = Counter(t for a in answers for t in a)
    ranked = sorted((t for t in counts if t not in eos), key=lambda t: (-counts[t], t))
    assert data.draft_vocab.tolist() == sorted(set(eos) | set(ranked[: 6 - len(eos)]))
    inside = sum(n for t, n in counts.items() if t in data.draft_vocab.tolist())
    assert data.info["draft_vocab_coverage"] == inside / sum(counts.values())


def test_draft_vocab_ties_go_to_the_lower_id_and_size_is_clipped():
    counts = answer_token_counts([[5, 5, 7, 7, 3, 9], [9, 1]], vocab_size=10)  # 5, 7, 9 twice; 1, 3 once
    assert choose_draft_vocab(counts, 3, [0]).tolist() == [0, 5, 7]
    assert choose_draft_vocab(counts, 100, [0, 2]).tolist() == [0, 1, 2, 3, 5, 7, 9]  # unseen tokens stay out
    assert coverage(counts, choose_draft_vocab(counts, 3, [0])) == 4 / 8
    with pytest.raises(ValueError, match="EOS"):
        choose_draft_vocab(counts, 1, [0, 2])


def test_held_out_coverage_measures_answers_the_vocab_was_not_chosen_from():
    answers = [[4, 4], [4, 5], [5, 5], [6, 7], [4]]  # the fourth is held out; 6 and 7 are nowhere else
    assert held_out_coverage(answers, 10, size=3, eos_ids=[0]) == 0.0
    assert held_out_coverage([[4, 6], [4], [4], [6, 4]], 10, size=2, eos_ids=[0]) == 0.5
    assert held_out_coverage(answers[:3], 10, size=3, eos_ids=[0]) is None


def hand_made() -> DrafterData:
    lengths = [5, 3]
    return DrafterData(
        token_ids=torch.tensor([10, 11, 12, 13, 14, 20, 21, 22], dtype=torch.int32),
        hidden=torch.arange(8 * 4, dtype=torch.float32).view(8, 4).to(torch.float16),
        lengths=torch.tensor(lengths),
        answer_starts=torch.tensor([3, 1]),
        draft_vocab=torch.tensor([1, 12, 14, 22]),
        vocab_size=30,
        info={"note": "hand-made"},
    )


def test_batch_rows_follow_eagle1s_layout():
    data = hand_made()
    batch = data.batch([1, 0])
    h = data.hidden.float()
    # conversation 1 (tokens 20 21 22, rows 5..7), then conversation 0 (tokens 10..14, rows 0..4)
    assert batch.input_ids.tolist() == [21, 22, 11, 12, 13, 14]  # x_{t+1}
    assert torch.equal(batch.hidden, torch.cat([h[5:7], h[0:4]]))  # h_t
    assert torch.equal(batch.target_hidden, torch.cat([h[6:8], h[1:5]]))  # h_{t+1}
    # x_{t+2} in the draft vocabulary [1, 12, 14, 22]: 22 -> 3, 12 -> 1, 14 -> 2; 13 outside it
    assert batch.target_draft.tolist() == [3, IGNORE_INDEX, 1, IGNORE_INDEX, 2, IGNORE_INDEX]
    assert batch.answer.tolist() == [True, True, False, False, True, True]  # t >= answer_start - 1
    assert batch.meta.lengths.tolist() == [2, 4] and batch.meta.positions().tolist() == [0, 1, 0, 1, 2, 3]


def test_batches_are_a_function_of_seed_and_epoch():
    data = DrafterData(
        token_ids=torch.zeros(60, dtype=torch.int32),
        hidden=torch.zeros(60, 2),
        lengths=torch.tensor([3, 7, 5, 11, 4, 6, 9, 2, 8, 5]),
        answer_starts=torch.ones(10, dtype=torch.int64),
        draft_vocab=torch.tensor([0]),
        vocab_size=1,
    )
    first = data.batches(max_rows=12, seed=1, epoch=0)
    assert first == data.batches(max_rows=12, seed=1, epoch=0)
    assert first != data.batches(max_rows=12, seed=1, epoch=1)
    assert sorted(c for b in first for c in b) == list(range(10))
    assert all(sum(int(data.lengths[c]) - 1 for c in b) <= 12 for b in first)


def test_save_and_load_round_trip_exactly(tiny, tmp_path):
    data = distill(tiny)
    loaded = DrafterData.load(data.save(tmp_path / "drafter_data"))
    for name in ("token_ids", "hidden", "lengths", "answer_starts", "draft_vocab", "offsets"):
        a, b = getattr(data, name), getattr(loaded, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert loaded.vocab_size == data.vocab_size and loaded.info == data.info
    with pytest.raises(ValueError, match="not a folder of drafter data"):
        DrafterData.load(tmp_path)


def test_same_seed_same_data(tiny):
    """Model-written prompts (sampled with seeds) and sampled answers: the same seed gives the same data."""
    config = {"num_prompts": 4, "prompt_max_tokens": 8, "max_tokens": 8, "temperature": 0.8}
    a, b = (collect(tiny, DistillConfig(**config, seed=3), False) for _ in range(2))
    assert a.info["prompts"] == b.info["prompts"]
    assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.hidden, b.hidden)
    other = collect(tiny, DistillConfig(**config, seed=4), False)
    assert other.info["prompts"] != a.info["prompts"]


def test_seed_tasks_visit_every_topic_before_repeating_one():
    tasks = seed_tasks(300, seed=0)
    assert len(tasks) == 300 and len({t for t, _ in tasks[: len(TOPICS)]}) == len(TOPICS)
    assert seed_tasks(20, seed=0) == tasks[:20] and seed_tasks(20, seed=1) != tasks[:20]


def test_clean_request_keeps_the_first_line_without_labels():
    assert clean_request('\n Question: "How do I boil pasta?"\nAnswer: ...') == "How do I boil pasta?"
    assert clean_request("**Request:** List three uses of DNA.") == "List three uses of DNA."
    assert clean_request("  \n ") == ""


def test_distill_config_is_checked():
    with pytest.raises(ValueError, match="hidden_dtype"):
        DistillConfig(hidden_dtype="int8")
    with pytest.raises(ValueError, match="max_tokens"):
        DistillConfig(max_tokens=0)


def test_smollm2_fast_path_figures(default_model_path, make_llm):
    """A handful of model-written prompts on the 4-bit fast path: the figures a training budget is planned from."""
    llm = make_llm(default_model_path, dtype="auto", kv_cache_gb=0.25, threads=None)
    data = collect(llm, DistillConfig(num_prompts=4, max_tokens=48), False)
    figures = data.info["figures"]
    print(
        f"\ngeneration {figures['generate_tokens_per_s']:.0f} answer tok/s, features "
        f"{figures['feature_tokens_per_s']:.0f} tok/s, {figures['answer_tokens_per_min']:.0f} answer tokens/min, "
        f"coverage {data.info['draft_vocab_coverage']:.3f}, prompts {data.info['prompts']}"
    )
    assert data.num_conversations == 4 and data.num_answer_tokens > 0
    assert bool(data.hidden.isfinite().all()) and data.hidden.shape[1] == 576
    assert len(data.draft_vocab) <= 8192 and data.info["draft_vocab_coverage"] == 1.0  # every answer token seen
