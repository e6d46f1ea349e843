"""Skeleton-of-thought on the tiny model (a 4,096-token context): the outline follows its grammar (3-5 numbered points), each point is
expanded by its own request in the same steps, and the answer joins the expansions in order."""

from __future__ import annotations

import re

from tokenloop import LLM, SamplingParams
from tokenloop.strategies import skeleton


def test_the_outline_follows_its_grammar_and_each_point_is_expanded_in_order(long_context_model_folder, monkeypatch):
    llm = LLM(long_context_model_folder, dtype="float32", device="cpu", kv_cache_gb=0.02)  # the prompts outgrow 256 tokens
    steps = []
    engine = llm.llm_engine
    real_step = engine.step
    monkeypatch.setattr(engine, "step", lambda: steps.append(len(engine.scheduler.running)) or real_step())
    result = llm.skeleton_of_thought("Hi", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert 3 <= len(result.points) <= 5 and len(result.expansions) == len(result.points)
    assert result.answer == "\n\n".join(e.strip() for e in result.expansions)
    assert max(steps) >= len(result.points)  # the expansions ran side by side
    outline = "\n".join(f"{i + 1}. {p}" for i, p in enumerate(result.points))
    assert re.fullmatch(skeleton.OUTLINE, outline)
    conversations = skeleton.expansion_conversations("Hi", outline, result.points)
    assert all(c[:2] == conversations[0][:2] for c in conversations)  # the question and outline: one shared prefix
