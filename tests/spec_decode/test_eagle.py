"""The EAGLE drafter (models/eagle.py, spec_decode/eagle.py): greedy tokens with it equal those without, on 50
prompts (float32 and the fast path) and inside a batch of 32; its head's KV blocks are all free again after
aborts and preemption; its folder round-trips and stays small; a drafter built for another target is refused at
start, both sizes named. Its heads are random (exactness does not depend on their quality): a seeded random one,
and one that drafts the last token again, so that drafts are accepted and rejected at every position."""

from __future__ import annotations

import random

import pytest
import torch

from tests.eagle_helpers import write_random_drafter
from tests.helpers import model_config
from tokenloop import SamplingParams
from tokenloop.models.eagle import load_drafter, read_config

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def prompts(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(2, 400) for _ in range(rng.randrange(3, 40))]} for _ in range(count)]


PROMPTS = prompts(50, seed=0)


def eagle(folder, k: int = 3) -> dict:
    return {"method": "eagle", "model": str(folder), "num_speculative_tokens": k, "adaptive": False}


def tokens(llm, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("dtype", ["float32", "auto"], ids=["float32", "fast path"])
def test_greedy_tokens_on_fifty_prompts_with_the_drafter_equal_those_without(
    make_llm, tiny_model_folder, tiny_drafter_folder, dtype
):
    plain = make_llm(tiny_model_folder, dtype=dtype)
    spec = make_llm(tiny_model_folder, dtype=dtype, speculative_config=eagle(tiny_drafter_folder))
    expected = [tokens(plain, [p])[0] for p in PROMPTS]
    assert [tokens(spec, [p])[0] for p in PROMPTS] == expected
    batch = PROMPTS[:32]
    assert tokens(spec, batch) == expected[:32]  # every step, some drafts accepted beside others rejected
    stats = spec.llm_engine.speculator.stats
    assert 0 < stats.accepted_per_position[2] <= stats.accepted_per_position[0] < stats.num_drafts
    assert stats.draft_seconds > 0 and stats.num_proposing_steps > 0


def test_a_random_drafter_changes_no_greedy_token_either(make_llm, tiny_model_folder, tmp_path):
    drafter = write_random_drafter(tmp_path / "drafter", tiny_model_folder, 64, seed=1)
    plain = make_llm(tiny_model_folder)
    spec = make_llm(tiny_model_folder, speculative_config=eagle(drafter, k=4))
    assert tokens(spec, PROMPTS[:32]) == tokens(plain, PROMPTS[:32])
    assert spec.llm_engine.speculator.stats.num_draft_tokens > 0


def test_seeded_sampling_with_the_drafter_is_the_same_alone_and_in_a_batch(
    make_llm, tiny_model_folder, tiny_drafter_folder
):
    spec = make_llm(tiny_model_folder, enable_prefix_caching=False, speculative_config=eagle(tiny_drafter_folder))
    params = [SamplingParams(temperature=0.8, top_k=50, seed=i, max_tokens=16, ignore_eos=True) for i in range(8)]
    alone = [tokens(spec, [p], q)[0] for p, q in zip(PROMPTS, params)]
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS[:8], params, use_tqdm=False)] == alone


def test_the_heads_blocks_are_free_after_aborts_and_preemption(make_llm, tiny_model_folder, tiny_drafter_folder):
    # 24 blocks of 16 tokens for 16 sequences of up to 55 tokens: sequences are preempted and recomputed.
    llm = make_llm(tiny_model_folder, kv_blocks=24, speculative_config=eagle(tiny_drafter_folder))
    engine = llm.llm_engine
    proposer = engine.speculator.proposer
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS[:16]]
    for step in range(12):
        engine.step()
        if step in (4, 8):
            engine.abort_request(ids[step])
            engine.abort_request(ids[step + 1])
    assert proposer.block_manager.num_used_blocks > 0
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.num_preemptions > 0
    assert engine.speculator.stats.num_accepted_tokens > 0
    assert not proposer.states and proposer.block_manager.num_used_blocks == 0
    # The others' tokens are those they get alone.
    plain = make_llm(tiny_model_folder)
    finished = [i for i in range(16) if i not in (4, 5, 8, 9)]
    assert engine.scheduler.num_preemptions > 0
    expected = tokens(plain, [PROMPTS[i] for i in finished])
    got = tokens(llm, [PROMPTS[i] for i in finished])  # again, on the warm engine
    assert got == expected


def test_the_drafter_folder_round_trips_and_holds_only_the_head(tiny_model_folder, tiny_drafter_folder):
    target = model_config(tiny_model_folder)
    head = load_drafter(tiny_drafter_folder, target)
    config = read_config(tiny_drafter_folder)
    assert (config.hidden_size, config.target_vocab_size, config.draft_vocab_size) == (64, 400, 300)
    assert head.d2t.shape == (300,) and bool((head.d2t[1:] > head.d2t[:-1]).all())
    assert not any("embed" in name or "lm_head" in name for name in head.state_dict())
    from safetensors.torch import load_file

    saved = load_file(str(tiny_drafter_folder / "model.safetensors"))
    assert all(torch.equal(saved[name], t) for name, t in head.state_dict().items())


@pytest.mark.parametrize(
    "change, message",
    [
        ({"hidden_size": 96}, "target hidden size of 96, the target's is 64"),
        ({"target_vocab_size": 500}, "target vocabulary of 500, the target's is 400"),
    ],
    ids=["hidden size", "vocabulary"],
)
def test_a_drafter_for_another_target_is_refused_at_start_naming_both_sizes(
    make_llm, tiny_model_folder, tmp_path, change, message
):
    drafter = write_random_drafter(tmp_path / "drafter", tiny_model_folder, 100, **change)
    with pytest.raises(ValueError, match=message):
        make_llm(tiny_model_folder, speculative_config=eagle(drafter))


def test_eagle_without_a_folder_takes_the_shipped_drafter_and_names_them_where_none_fits(make_llm, tiny_model_folder):
    from tokenloop.models.eagle import SHIPPED_DRAFTERS, shipped_drafter
    from tokenloop.models.store import KNOWN_MODELS

    default = SHIPPED_DRAFTERS / "smollm2-135m-instruct"
    assert shipped_drafter(None) == shipped_drafter("smollm2-135m-instruct") == default
    assert shipped_drafter(f"/anywhere/{KNOWN_MODELS['smollm2-135m-instruct'].filename}") == default
    with pytest.raises(ValueError, match="model is required for method 'eagle'.*drafters for smollm2-135m-instruct"):
        make_llm(tiny_model_folder, speculative_config={"method": "eagle"})


def test_the_shipped_drafter_is_under_10_mb_and_names_its_command_commit_and_checksum():
    import hashlib
    import json

    from tokenloop.models.eagle import shipped_drafter

    folder = shipped_drafter(None)
    weights = (folder / "model.safetensors").read_bytes()
    provenance = json.loads((folder / "provenance.json").read_text())
    assert len(weights) <= 10 * 2**20
    assert provenance["sha256"] == hashlib.sha256(weights).hexdigest()
    assert provenance["command"].startswith("tokenloop train-drafter ") and provenance["commit"]
    assert read_config(folder).target_vocab_size == 49152


def test_metrics_and_stats_show_acceptance_per_position_and_draft_ms(make_llm, tiny_model_folder, tiny_drafter_folder):
    from prometheus_client import generate_latest

    from tokenloop.engine.metrics import EngineMetrics

    llm = make_llm(tiny_model_folder, speculative_config=eagle(tiny_drafter_folder))
    tokens(llm, PROMPTS[:8])
    metrics = EngineMetrics()
    metrics.observe_engine(llm.llm_engine)
    text = generate_latest(metrics.registry).decode()
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if not line.startswith("#")}
    assert values["tokenloop_spec_decode_draft_ms_per_step"] > 0
    assert values["tokenloop_spec_decode_mean_accepted_length"] > 1
    assert values['tokenloop_spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] > 0
    summary = llm.llm_engine.speculator.stats.summary()
    assert "acceptance per position [" in summary and "ms/step" in summary


def test_generate_stats_print_the_speculation_line(tiny_model_folder, tiny_drafter_folder, capsys):
    import json

    from tokenloop.cli import main

    spec = json.dumps(eagle(tiny_drafter_folder))
    args = ["generate", "Hello", "--model", str(tiny_model_folder), "--max-tokens", "8", "--dtype", "float32"]
    assert main(args + ["--speculative-config", spec, "--stats"]) == 0
    assert "speculation: " in capsys.readouterr().err


# On the default model (SmolLM2-135M): the drafter that ships for it.


@pytest.fixture(scope="module")
def real_drafter():
    from tokenloop.models.eagle import shipped_drafter

    return shipped_drafter(None)


def test_the_shipped_drafter_fits_the_default_model(default_model_path, real_drafter):
    head = load_drafter(real_drafter, model_config(default_model_path))
    assert head.config.hidden_size == model_config(default_model_path).hidden_size


@pytest.mark.parametrize("dtype", ["float32", "auto"], ids=["float32", "fast path"])
def test_real_greedy_tokens_on_fifty_prompts_with_the_drafter_equal_those_without(
    default_model_path, real_drafter, dtype
):
    from tests.spec_decode.test_real_model import PROMPTS as REAL_PROMPTS
    from tests.spec_decode.test_real_model import chat_tokens
    from tokenloop import LLM

    plain = LLM(default_model_path, dtype=dtype, device="cpu")
    spec = LLM(default_model_path, dtype=dtype, device="cpu", speculative_config=eagle(real_drafter, k=4))
    assert chat_tokens(spec, REAL_PROMPTS) == chat_tokens(plain, REAL_PROMPTS)
    batch = REAL_PROMPTS[:32]
    assert chat_tokens(spec, batch) == chat_tokens(plain, batch)
    stats = spec.llm_engine.speculator.stats
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens
    assert spec.llm_engine.speculator.proposer.block_manager.num_used_blocks == 0
