"""tokenloop's self_consistency extension on completions and chat (tiny model, the real openai client): the
reply is the winning sample with the votes; a bad answer spec or a stream is a 400 naming the field."""

from __future__ import annotations

import openai
import pytest

from tests.server.conftest import MODEL_NAME

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["red", "green", "blue"]}},
    "required": ["answer"],
    "additionalProperties": False,
}


def test_self_consistency_returns_the_winning_sample_and_the_votes(client):
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        n=7,
        max_tokens=40,
        temperature=1.0,
        seed=4,
        extra_body={"self_consistency": {"answer": SCHEMA}},
    )
    votes = out.model_extra["self_consistency"]
    assert votes["answer"] in {"red", "green", "blue"} and 0 < sum(votes["votes"].values()) <= votes["samples"] <= 7
    assert len(out.choices) == 1 and f'"{votes["answer"]}"' in out.choices[0].message.content
    text = client.completions.create(
        model=MODEL_NAME,
        prompt="Hello",
        n=5,
        max_tokens=12,
        temperature=1.0,
        seed=4,
        extra_body={"self_consistency": {"answer": r"([a-z])"}},
    )
    assert text.model_extra["self_consistency"]["samples"] <= 5 and len(text.choices) == 1


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"self_consistency": {"answer": r"no group"}}, "self_consistency"),
        ({"self_consistency": {"answer": {"type": "object"}}}, "self_consistency"),
        ({"self_consistency": {"answer": r"(x)"}, "stream": True}, "stream"),
    ],
)
def test_bad_self_consistency_requests_are_a_400(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt="Hello", n=3, max_tokens=4, extra_body=extra)
    assert e.value.body["param"] == param
