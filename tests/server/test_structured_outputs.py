"""Structured output through the real server and the openai client (tiny random model: the grammar alone makes
its output valid): JSON schemas via response_format, vLLM's structured_outputs (regex, choice, grammar, json),
and 400s naming the field for specs that cannot be honoured."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tests.server.conftest import MODEL_NAME

HI = [{"role": "user", "content": "Give me JSON."}]
# Bounded strings and numbers: a random model wanders inside the grammar, and these bounds make every path end.
SCHEMAS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 7}, "tag": {"enum": ["a", "b"]}},
        "required": ["n", "tag"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 3},
    # (integers: a number's fraction has no bound on its digits, which a random model keeps writing)
    {
        "type": "object",
        "properties": {
            "kind": {"const": "point"},
            "xy": {
                "type": "array",
                "items": {"type": "integer", "minimum": -1, "maximum": 1},
                "minItems": 2,
                "maxItems": 2,
            },
        },
        "required": ["kind", "xy"],
        "additionalProperties": False,
    },
    {
        "$defs": {"leaf": {"type": "string", "pattern": "^[a-z]{1,4}$"}},
        "type": "object",
        "properties": {"v": {"anyOf": [{"$ref": "#/$defs/leaf"}, {"type": "null"}]}},
        "required": ["v"],
        "additionalProperties": False,
    },
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=[f"schema{i}" for i in range(len(SCHEMAS))])
@pytest.mark.parametrize("temperature", [0, 0.8])
def test_json_schema_outputs_parse_and_validate(client, schema, temperature):
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=HI,
        max_tokens=200,
        temperature=temperature,
        seed=5,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}},
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), schema)


def test_regex_choice_json_object_and_grammar_through_structured_outputs(client):
    def complete(spec, **extra):
        out = client.completions.create(
            model=MODEL_NAME,
            prompt="Hello",
            max_tokens=60,
            temperature=0.8,
            seed=2,
            extra_body={"structured_outputs": spec},
            **extra,
        )
        return out.choices[0]

    regex = complete({"regex": r"[0-9]{2}-[a-c]{3}"})
    assert re.fullmatch(r"[0-9]{2}-[a-c]{3}", regex.text) and regex.finish_reason == "stop"
    assert complete({"choice": ["red", "green", "blue"]}).text in {"red", "green", "blue"}
    lark = complete({"grammar": 'start: "(" NUM ")"\nNUM: /[0-9]{1,3}/'})
    assert re.fullmatch(r"\([0-9]{1,3}\)", lark.text)
    obj = client.chat.completions.create(
        model=MODEL_NAME, messages=HI, max_tokens=200, temperature=0, response_format={"type": "json_object"}
    )
    if obj.choices[0].finish_reason == "stop":  # any object: a random model may fill all 200 tokens inside it
        assert isinstance(json.loads(obj.choices[0].message.content), dict)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"structured_outputs": {"regex": "("}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {
                            "type": "object",
                            "properties": {"a": {"type": "string", "format": "no-such-format"}},
                        },
                    },
                }
            },
            "response_format",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format"),
    ],
)
def test_specs_that_cannot_be_honoured_are_a_400(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=HI, max_tokens=5, extra_body=body)
    error = e.value.body
    if param:
        assert error["param"].startswith(param), error
    ok = client.chat.completions.create(model=MODEL_NAME, messages=HI, max_tokens=3)
    assert ok.choices[0].message.content is not None  # the server goes on
