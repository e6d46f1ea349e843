"""Tool calling through the real server and the openai client, on the default model (the tiny one's 256-token
context cannot hold the tools' listing): with tool_choice required or named, every call's arguments validate
(the grammar makes them); auto gives text or a valid call;
streamed deltas add up to the non-streamed message; a tool result in the next turn is read; bad tools are 400s."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.server.conftest import MODEL_NAME
from tokenloop.tools.calling import ToolCalling, format_call, render_tools
from tokenloop.tools.parser import parse_reply

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "pattern": "^[A-Za-z]{1,8}$"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
COUNT = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["n"],
    "additionalProperties": False,
}
NESTED = {
    "$defs": {
        "pt": {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 9}, "minItems": 2, "maxItems": 2}
    },
    "type": "object",
    "properties": {"from": {"$ref": "#/$defs/pt"}, "to": {"$ref": "#/$defs/pt"}, "fast": {"type": "boolean"}},
    "required": ["from", "to"],
    "additionalProperties": False,
}
NOTHING = {"type": "object", "properties": {}, "additionalProperties": False}


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": f"the {name} tool", "parameters": parameters}}


TOOLS = [tool("get_weather", WEATHER), tool("count", COUNT), tool("route", NESTED), tool("ping", NOTHING)]
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def ask(client, **kw):
    kw = {"model": MODEL_NAME, "messages": ASK, "tools": TOOLS, "max_tokens": 160, "temperature": 0.8, "seed": 1} | kw
    return client.chat.completions.create(**kw)


def assert_valid_calls(message, names=None) -> None:
    assert message.tool_calls, message.content
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])


# Ten cases: required or named, over four tools, seeds and temperatures, parallel calls on and off.
CASES = [
    ("required", 0, 1, True),
    ("required", 0.8, 2, True),
    ("required", 1.2, 3, False),
    ("required", 0.8, 4, False),
    ("get_weather", 0, 5, True),
    ("get_weather", 0.8, 6, False),
    ("count", 0.8, 7, True),
    ("route", 0.8, 8, True),
    ("route", 1.0, 9, False),
    ("ping", 0.8, 10, True),
]


@pytest.mark.parametrize("choice, temperature, seed, parallel", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CASES])
def test_required_or_named_tool_choice_gives_calls_whose_arguments_validate(
    real_client, choice, temperature, seed, parallel
):
    tool_choice = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    out = ask(real_client, tool_choice=tool_choice, temperature=temperature, seed=seed, parallel_tool_calls=parallel)
    (c,) = out.choices
    assert_valid_calls(c.message, None if choice == "required" else {choice})
    # One call, then only EOS may follow. Parallel required calls may go on (a 135M model greedy repeats its call until
    # max_tokens): every call returned is complete and valid, and the one cut short is not returned.
    assert (
        c.finish_reason == "tool_calls"
        if not parallel or choice != "required"
        else c.finish_reason in ("tool_calls", "length")
    )
    assert len(c.message.tool_calls) == 1 or parallel and choice == "required"  # a named function is called once


@pytest.mark.parametrize("seed", range(4))
def test_auto_gives_text_or_a_valid_call(real_client, seed):
    c = ask(real_client, tool_choice="auto", seed=seed, max_tokens=60).choices[0]
    if c.message.tool_calls:
        assert c.finish_reason == "tool_calls"
        assert_valid_calls(c.message)
    else:
        assert "<tool_call>" not in (c.message.content or "") and c.finish_reason in ("stop", "length")


def test_streamed_tool_call_deltas_reassemble_to_the_message(real_client):
    kw = {"tool_choice": "required", "temperature": 0, "parallel_tool_calls": False}
    whole = ask(real_client, **kw).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in ask(real_client, stream=True, **kw):
        (choice,) = chunk.choices
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": delta.id, "name": delta.function.name, "arguments": ""})
            call["arguments"] += delta.function.arguments or ""
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (t.function.name, t.function.arguments) for t in whole.message.tool_calls
    ]
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_a_tool_result_in_the_next_turn_is_read(real_client):
    first = ask(real_client, tool_choice={"type": "function", "function": {"name": "count"}}).choices[0].message
    turn = ASK + [
        first.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": '{"n": 3}'},
    ]
    reply = ask(real_client, messages=turn, tool_choice="none", max_tokens=8)
    assert (
        reply.choices[0].message.tool_calls is None
        and reply.usage.prompt_tokens > ask(real_client, tool_choice="none", max_tokens=8).usage.prompt_tokens
    )


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        (
            {
                "tools": [
                    tool("bad", {"type": "object", "properties": {"x": {"type": "string", "format": "no-such-format"}}})
                ]
            },
            "tools",
        ),
        ({"tools": [tool("bad", {"type": "object", "properties": {"x": {"type": "wrong"}}})]}, "tools"),
        ({"tools": [tool("twice", COUNT), tool("twice", WEATHER)]}, "tools"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
    ],
)
def test_bad_tools_are_400s_naming_the_field(real_client, kw, param):
    if kw.get("tools", TOOLS) is None:
        kw.pop("tools")
        kw["tools"] = openai.NOT_GIVEN
    with pytest.raises(openai.BadRequestError) as e:
        ask(real_client, **kw)
    assert e.value.body["param"] == param, e.value.body
    # The server goes on: one call, then the grammar leaves only EOS (parallel calls could run to max_tokens).
    c = ask(real_client, tool_choice="required", parallel_tool_calls=False).choices[0]
    assert c.finish_reason == "tool_calls"
    assert_valid_calls(c.message)


def test_the_default_rendering_lists_the_tools_and_writes_calls_and_results_in_the_call_format():
    calling = ToolCalling([], "none")
    assert calling.structured_outputs() is None
    messages = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "count", "arguments": {"n": 1}}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    from tokenloop.tools.calling import Function

    rendered = render_tools(messages, [Function("count", "counts", COUNT)])
    assert (
        rendered[0]["role"] == "system"
        and '"name": "count"' in rendered[0]["content"]
        and "<tool_call>" in rendered[0]["content"]
    )
    assert rendered[2]["content"] == format_call("count", {"n": 1})
    assert rendered[3] == {"role": "user", "content": "<tool_response>\nok\n</tool_response>"}


def test_the_parser_only_ever_extends_what_it_gave_before():
    text = (
        "Let me see. "
        + format_call("get_weather", {"city": "Paris", "unit": "c"})
        + "\n"
        + format_call("route", {"from": [1, 2], "to": [3, 4]})
    )
    before = parse_reply("", False)
    for end in range(1, len(text) + 1):
        now = parse_reply(text[:end], end == len(text))
        assert now.content.startswith(before.content)
        assert all(a.name == b.name and b.arguments.startswith(a.arguments) for a, b in zip(before.calls, now.calls))
        before = now
    assert before.content == "Let me see. " and [(c.name, json.loads(c.arguments)) for c in before.calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}),
        ("route", {"from": [1, 2], "to": [3, 4]}),
    ]
    assert parse_reply(text[:-5], True).calls[-1].name == "get_weather"  # a call cut short is not a call


def test_a_template_that_takes_tools_gets_them_and_call_arguments_as_objects():
    from tokenloop.tokenizer.chat_template import render_chat_template
    from tokenloop.tools.calling import Function

    template = (
        "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}<{{ c.function.arguments.n }}>{% endfor %};{% endfor %}"
    )
    calling = ToolCalling([Function("count", None, COUNT)], "auto")
    messages = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "count", "arguments": '{"n": 5}'}}],
        },
    ]
    rendered, kwargs = calling.render(messages, template_takes_tools=True)
    assert render_chat_template(template, rendered, False, None, None, **kwargs) == "[count]user:hi;assistant:<5>;"
    bad = [messages[0], {**messages[1], "tool_calls": [{"function": {"name": "count", "arguments": "{not json"}}]}]
    with pytest.raises(ValueError, match="^messages: a tool call's arguments are not JSON"):
        calling.render(bad, template_takes_tools=True)


def test_llm_chat_renders_the_tools_it_is_given(tiny_llm):
    prompt = tiny_llm.chat_prompt([{"role": "user", "content": "hi"}], tools=[tool("count", COUNT)])["prompt"]
    assert '"name": "count"' in prompt and "<tool_call>" in prompt
