"""Self-consistency: answers read by a regex or a schema's answer field, votes counted as samples finish,
counting stopped (the rest aborted) once the leader cannot be overtaken; bad answer specs are ValueErrors."""

from __future__ import annotations

import pytest

from tokenloop import SamplingParams
from tokenloop.outputs import CompletionOutput, RequestOutput
from tokenloop.strategies.self_consistency import AnswerSpec, VoteCounter


def finished(*texts: str | None) -> RequestOutput:
    """An output of len(texts) samples; None = still running."""
    outputs = [CompletionOutput(i, t or "", [], None, None, None if t is None else "stop") for i, t in enumerate(texts)]
    return RequestOutput("r", None, [1], outputs, finished=False)


def test_the_vote_is_decided_as_soon_as_the_leader_cannot_be_overtaken():
    counter = VoteCounter(AnswerSpec(regex=r"answer is (\d+)"), n=5)
    assert not counter.update(finished("the answer is 4", None, "the answer is 4", None, None))  # 2-0, 3 to go
    assert counter.update(finished("the answer is 4", "the answer is 4", "the answer is 4", None, None))  # 3-0, 2 to go
    vote = counter.result()
    assert vote.answer == "4" and vote.votes == {"4": 3} and vote.confidence == 1.0 and vote.stopped_early
    assert vote.winner is vote.samples[0] and len(vote.samples) == 3


def test_ties_go_to_the_first_answer_counted_and_unanswered_samples_do_not_vote():
    counter = VoteCounter(AnswerSpec(regex=r"answer is (\d+)"), n=4)
    assert counter.update(finished("answer is 1 then answer is 2", "no idea", "answer is 3", "answer is 2"))
    vote = counter.result()  # the last match of a sample is its answer
    assert (
        vote.votes == {"2": 2, "3": 1}
        and vote.answer == "2"
        and vote.confidence == pytest.approx(2 / 3)
        and not vote.stopped_early
    )


def test_an_answer_field_of_a_schema_is_read_from_the_json():
    spec = AnswerSpec(schema={"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]})
    assert spec.read('{"answer": 12}') == "12" and spec.read("not json") is None
    assert spec.params(SamplingParams(), 4).structured_outputs.json == spec.schema


@pytest.mark.parametrize(
    "kw", [{"regex": r"answer is \d+"}, {"regex": r"(a)(b)"}, {"regex": "("}, {"schema": {"type": "object"}}, {}]
)
def test_bad_answer_specs_are_a_value_error_naming_answer(kw):
    with pytest.raises(ValueError, match="^answer"):
        AnswerSpec(**kw)


def test_self_consistency_on_the_tiny_model_votes_over_forked_samples_and_frees_them(tiny_llm):
    schema = {
        "type": "object",
        "properties": {"answer": {"enum": ["red", "green", "blue"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    vote = tiny_llm.self_consistency("Hello world", 9, schema, SamplingParams(temperature=1.0, seed=2, max_tokens=60))
    assert (
        vote.answer in {"red", "green", "blue"} and 0 < sum(vote.votes.values()) <= len(vote.samples) <= 9
    )  # a sample cut at max_tokens gives none
    assert vote.votes[vote.answer] == max(vote.votes.values()) and vote.winner is not None
    again = tiny_llm.self_consistency("Hello world", 9, schema, SamplingParams(temperature=1.0, seed=2, max_tokens=60))
    assert again.votes == vote.votes  # seeded: the same samples
    engine = tiny_llm.llm_engine
    assert not engine.requests and all(b.ref_count == 0 for b in engine.block_manager.blocks)
