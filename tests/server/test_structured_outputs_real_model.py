"""Structured output on the default model through the server and the openai client: 20 JSON schemas of the kinds users
write in OpenAI's strict mode (closed objects; nested objects, bounded arrays, enums, const, anyOf, $ref/$defs,
patterns, integer and number bounds, nullable types), asked for in words, at temperature 0 and at 0.8 with a seed. A
request's tokens do not depend on what runs beside it, so which outputs stop within 512 tokens is pinned, schema by
schema: every output that stops parses and validates, and every one that does not is a prefix its grammar still accepts.
Regex outputs fullmatch; choices are in the set."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest

from tests.server.conftest import MODEL_NAME

NAME = {"type": "string", "minLength": 1, "maxLength": 30}
SCHEMAS = {
    "a person": {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 130}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "a book": {
        "type": "object",
        "properties": {"title": NAME, "author": NAME, "year": {"type": "integer", "minimum": 1400, "maximum": 2030}},
        "required": ["title", "author", "year"],
    },
    "a weather report": {
        "type": "object",
        "properties": {
            "city": NAME,
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "temperature": {"type": "number", "minimum": -90, "maximum": 60},
        },
        "required": ["city", "unit", "temperature"],
    },
    "three colours": {
        "type": "array",
        "items": {"enum": ["red", "green", "blue", "yellow", "black", "white"]},
        "minItems": 3,
        "maxItems": 3,
    },
    "a shopping list": {
        "type": "object",
        "properties": {"items": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 5}},
        "required": ["items"],
        "additionalProperties": False,
    },
    "a point": {
        "type": "object",
        "properties": {"type": {"const": "point"}, "x": {"type": "integer"}, "y": {"type": "integer"}},
        "required": ["type", "x", "y"],
        "additionalProperties": False,
    },
    "a user with an address": {
        "type": "object",
        "properties": {
            "name": NAME,
            "address": {
                "type": "object",
                "properties": {"street": NAME, "city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["street", "city", "zip"],
            },
        },
        "required": ["name", "address"],
    },
    "an id or a name": {
        "type": "object",
        "properties": {"who": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 1000}, NAME]}},
        "required": ["who"],
    },
    "a tree node": {
        "$defs": {
            "leaf": {
                "type": "object",
                "properties": {"label": NAME},
                "required": ["label"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"label": NAME, "children": {"type": "array", "items": {"$ref": "#/$defs/leaf"}, "maxItems": 3}},
        "required": ["label", "children"],
        "additionalProperties": False,
    },
    "a middle name, or null": {
        "type": "object",
        "properties": {"first": NAME, "middle": {"type": ["string", "null"], "maxLength": 40}},
        "required": ["first", "middle"],
        "additionalProperties": False,
    },
    "an email address": {
        "type": "object",
        "properties": {"email": {"type": "string", "pattern": "^[a-z0-9.]{1,20}@[a-z0-9]{1,20}\\.[a-z]{2,3}$"}},
        "required": ["email"],
    },
    "a score between 0 and 1": {
        "type": "object",
        "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["score"],
    },
    "a product": {
        "type": "object",
        "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 10000},
            "tags": {"type": "array", "items": NAME, "maxItems": 4},
        },
        "required": ["sku", "price"],
    },
    "a yes or no answer": {
        "type": "object",
        "properties": {"answer": {"type": "boolean"}, "reason": NAME},
        "required": ["answer", "reason"],
    },
    "an event": {
        "type": "object",
        "properties": {
            "name": NAME,
            "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
            "attendees": {"type": "integer", "minimum": 0, "maximum": 100000},
        },
        "required": ["name", "date"],
    },
    "a matrix of two rows": {
        "type": "array",
        "items": {
            "type": "array",
            "items": {"type": "integer", "minimum": -100, "maximum": 100},
            "minItems": 2,
            "maxItems": 2,
        },
        "minItems": 2,
        "maxItems": 2,
    },
    "a status": {
        "type": "object",
        "properties": {
            "status": {"enum": ["ok", "warning", "error"]},
            "code": {"type": "integer", "minimum": 100, "maximum": 599},
        },
        "required": ["status", "code"],
        "additionalProperties": False,
    },
    "a recipe": {
        "$defs": {
            "ingredient": {
                "type": "object",
                "properties": {"name": NAME, "grams": {"type": "integer", "minimum": 1, "maximum": 5000}},
                "required": ["name", "grams"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {
            "dish": NAME,
            "ingredients": {"type": "array", "items": {"$ref": "#/$defs/ingredient"}, "minItems": 1, "maxItems": 4},
        },
        "required": ["dish", "ingredients"],
        "additionalProperties": False,
    },
    "a shape": {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "kind": {"const": "circle"},
                    "radius": {"type": "integer", "minimum": 1, "maximum": 100},
                },
                "required": ["kind", "radius"],
                "additionalProperties": False,
            },
            {
                "type": "object",
                "properties": {"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1, "maximum": 100}},
                "required": ["kind", "side"],
                "additionalProperties": False,
            },
        ]
    },
    "a nullable count": {
        "type": "object",
        "properties": {"count": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 50}, {"type": "null"}]}},
        "required": ["count"],
    },
    "a movie review": {
        "type": "object",
        "properties": {
            "movie": NAME,
            "stars": {"type": "integer", "minimum": 1, "maximum": 5},
            "summary": {"type": "string", "maxLength": 120},
        },
        "required": ["movie", "stars", "summary"],
        "additionalProperties": False,
    },
}


def _closed(schema):
    """additionalProperties: false on every object schema, as OpenAI's strict mode requires of its users: an
    open object lets a small model add keys until max_tokens (it did, for 5 of 21 schemas)."""
    if isinstance(schema, dict):
        schema = {k: _closed(v) for k, v in schema.items()}
        if "properties" in schema:
            schema.setdefault("additionalProperties", False)
    elif isinstance(schema, list):
        schema = [_closed(v) for v in schema]
    return schema


# One open object stays: its extra keys must validate too.
SCHEMAS = {what: schema if what == "an id or a name" else _closed(schema) for what, schema in SCHEMAS.items()}


async def _ask(client, what: str, schema: dict, temperature: float):
    return await client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": f"Describe {what} as JSON."}],
        max_tokens=512,
        temperature=temperature,
        seed=7,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}},
    )


# The schemas whose output does not stop within 512 tokens, at each temperature (the others stop).
UNSTOPPED = {0: {"a recipe"}, 0.8: set()}


@pytest.fixture(scope="module")
def grammars(default_model_path):
    from tokenloop import LLM

    return LLM(default_model_path, compile=False, kv_cache_gb=0.01).llm_engine.input_processor


@pytest.mark.parametrize("temperature", [0, 0.8])
def test_twenty_json_schemas_stop_as_pinned_and_validate_or_stay_in_their_grammar(real_server, grammars, temperature):
    from tokenloop.sampling.structured import StructuredOutputsParams

    assert len(SCHEMAS) >= 20

    async def run():
        async with real_server.async_client() as client:
            return await asyncio.gather(*(_ask(client, what, schema, temperature) for what, schema in SCHEMAS.items()))

    outs = asyncio.run(run())
    unstopped = set()
    for (what, schema), out in zip(SCHEMAS.items(), outs):
        choice = out.choices[0]
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), schema)
            continue
        assert choice.finish_reason == "length", (what, choice)
        unstopped.add(what)
        matcher = grammars.grammars().matcher(StructuredOutputsParams(json=schema))
        matcher.sync(
            grammars.tokenizer.encode(choice.message.content, add_special_tokens=False)
        )  # raises if the grammar refuses
    assert unstopped == UNSTOPPED[temperature]


def test_regex_and_choice_on_the_default_model(real_client):
    date = r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
    for temperature in (0, 0.8):
        out = real_client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "When is the next full moon?"}],
            max_tokens=40,
            temperature=temperature,
            seed=3,
            extra_body={"structured_outputs": {"regex": date}},
        )
        assert re.fullmatch(date, out.choices[0].message.content) and out.choices[0].finish_reason == "stop"
        colours = ["red", "green", "blue"]
        out = real_client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "What colour is the sky?"}],
            max_tokens=10,
            temperature=temperature,
            seed=3,
            extra_body={"structured_outputs": {"choice": colours}},
        )
        assert out.choices[0].message.content in colours
