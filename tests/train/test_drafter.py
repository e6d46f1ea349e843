"""An EAGLE head trained in seconds on the tiny model's own answers: its losses fall, its top-1 agreement with the
target rises, and, served as a drafter, it changes no greedy token while some of its drafts are accepted."""

from __future__ import annotations

import torch

from tests.train.test_drafter_data import PROMPTS
from tokenloop.models.eagle import save_drafter
from tokenloop.models.loader import load_model
from tokenloop.sampling.params import SamplingParams
from tokenloop.train.drafter import DrafterTrainConfig, head_losses, train_head
from tokenloop.train.drafter_data import DistillConfig, collect


def test_a_head_trained_in_seconds_drafts_for_its_target(make_llm, tiny_model_folder, tmp_path):
    llm = make_llm(tiny_model_folder)
    data = collect(llm, DistillConfig(prompts=PROMPTS * 4, max_tokens=24, draft_vocab_size=96), progress=False)
    target = load_model(tiny_model_folder, torch.float32, torch.device("cpu"), load_tokenizer=False)
    head, metrics = train_head(target, data, DrafterTrainConfig(epochs=30, max_rows=64, warmup_steps=5), False)
    first, last = metrics[0], metrics[-1]
    assert last["feature"] < first["feature"] and last["token"] < first["token"], (first, last)
    assert last["top1"] > first["top1"], (first, last)
    # HASS-style: a second pass reads the head's own features; the first pass's figures are unchanged by it
    batch = data.batch(list(range(4)))
    rows = target.model.lm_head.weight[data.draft_vocab]
    eagle_only, with_own = (head_losses(head, target.model, rows, batch, passes) for passes in (0, 1))
    assert with_own["top1"] == eagle_only["top1"] and with_own["feature"] == eagle_only["feature"]
    assert with_own["loss"] > eagle_only["loss"]

    folder = save_drafter(head.to(torch.bfloat16), tmp_path / "drafter")
    spec = {"method": "eagle", "model": str(folder), "num_speculative_tokens": 3, "adaptive": False}
    drafted = make_llm(tiny_model_folder, speculative_config=spec)
    prompts = [llm.chat_prompt([{"role": "user", "content": p}]) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=24)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with_drafts = [o.outputs[0].token_ids for o in drafted.generate(prompts, params, use_tqdm=False)]
    assert with_drafts == alone
    assert drafted.llm_engine.speculator.stats.num_accepted_tokens > 0
