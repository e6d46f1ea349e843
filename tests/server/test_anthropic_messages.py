"""Anthropic's Messages API through a real server and the `anthropic` SDK as it is: one path with OpenAI's chat (the
same conversation at temperature 0, or seeded, gives the same text and token counts), stop reasons, streamed
events in Anthropic's order adding up to the message, count_tokens, errors in Anthropic's shape, and on the
default model tool calls whose input validates, streamed and in a round trip."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from tests.server.conftest import API_KEY, MODEL_NAME
from tests.server.test_tool_calls import COUNT, WEATHER
from tokenloop.server.anthropic_protocol import MessagesRequest

SYSTEM = "Be brief."
TURNS = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": [{"type": "text", "text": "How "}, {"type": "text", "text": "are you?"}]},
]
# The same conversation in OpenAI chat's terms.
OPENAI_TURNS = [{"role": "system", "content": SYSTEM}] + [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "How are you?"},
]


def sdk(server, api_key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=server.api_key or api_key, max_retries=0, timeout=60)


# This SDK's create() no longer takes the sampling fields (newer models refuse them): they go as extra_body.
SAMPLING = ("temperature", "top_p", "top_k", "seed")


def sampled(kw: dict) -> dict:
    extra = {name: kw.pop(name) for name in SAMPLING if name in kw}
    return kw | ({"extra_body": kw.get("extra_body", {}) | extra} if extra else {})


def create(server, **kw) -> anthropic.types.Message:
    kw = {"model": MODEL_NAME, "system": SYSTEM, "messages": TURNS, "max_tokens": 12, "temperature": 0} | kw
    return sdk(server).messages.create(**sampled(kw))


def chat(server, **kw):
    kw = {"model": MODEL_NAME, "messages": OPENAI_TURNS, "max_tokens": 12, "temperature": 0} | kw
    return server.client().chat.completions.create(**kw)


def text_of(message: anthropic.types.Message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def input_tokens(usage) -> int:
    """The prompt's tokens: Anthropic counts those read from the cache apart."""
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def test_greedy_reply_is_the_chat_completion_of_the_same_conversation(server):
    message, completion = create(server), chat(server)
    assert text_of(message) == completion.choices[0].message.content
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[completion.choices[0].finish_reason]
    assert (input_tokens(message.usage), message.usage.output_tokens) == (
        completion.usage.prompt_tokens,
        completion.usage.completion_tokens,
    )
    assert message.id.startswith("msg_") and message.role == "assistant" and message.model == MODEL_NAME
    assert message.stop_sequence is None


def test_a_seeded_sample_is_the_chat_completion_with_the_same_seed(server):
    kw = {"temperature": 0.9, "top_p": 0.95, "max_tokens": 10}
    message = create(server, top_k=50, seed=7, **kw)
    completion = chat(server, seed=7, extra_body={"top_k": 50}, **kw)
    assert text_of(message) == completion.choices[0].message.content


def test_count_tokens_is_the_prompt_a_message_reports(server):
    count = sdk(server).messages.count_tokens(model=MODEL_NAME, system=SYSTEM, messages=TURNS)
    assert count.input_tokens == input_tokens(create(server, max_tokens=1).usage) == chat(server).usage.prompt_tokens


def test_max_tokens_ends_with_stop_reason_max_tokens(server):
    message = create(server, max_tokens=3)
    assert (message.stop_reason, message.usage.output_tokens) == ("max_tokens", 3)


def test_a_stop_sequence_ends_the_reply_and_is_named(server):
    full = text_of(create(server, max_tokens=24))
    stop = next(full[i : i + 2] for i in range(2, len(full) - 2) if full[i : i + 2].strip() == full[i : i + 2])
    message = create(server, max_tokens=24, stop_sequences=["never-written", stop])
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    assert text_of(message) == full[: full.index(stop)]


def test_a_last_assistant_turn_is_continued(server):
    turns = TURNS + [{"role": "assistant", "content": "I am"}]
    message = create(server, messages=turns)
    completion = chat(
        server,
        messages=OPENAI_TURNS + [{"role": "assistant", "content": "I am"}],
        extra_body={"add_generation_prompt": False, "continue_final_message": True},
    )
    assert text_of(message) == completion.choices[0].message.content


def test_a_blank_last_assistant_turn_is_no_prefill(server):
    assert text_of(create(server, messages=TURNS + [{"role": "assistant", "content": " "}])) == text_of(create(server))


def test_streamed_text_and_final_message_are_the_message(server):
    whole = create(server, max_tokens=16)
    with sdk(server).messages.stream(
        model=MODEL_NAME, system=SYSTEM, messages=TURNS, max_tokens=16, extra_body={"temperature": 0}
    ) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text_of(whole) == text_of(final)
    assert (final.stop_reason, final.stop_sequence) == (whole.stop_reason, whole.stop_sequence)
    assert (input_tokens(final.usage), final.usage.output_tokens) == (
        input_tokens(whole.usage),
        whole.usage.output_tokens,
    )


def raw_events(server, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of a streamed reply, read with httpx."""
    headers = {"x-api-key": server.api_key or "unused", "anthropic-version": "2023-06-01"}
    events, name = [], None
    with httpx.stream("POST", f"{server.url}/v1/messages", json=body, headers=headers, timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                events.append((name, json.loads(line.removeprefix("data: "))))
    return events


def test_raw_stream_events_come_in_anthropics_order(server):
    body = {"model": MODEL_NAME, "messages": TURNS, "max_tokens": 5, "temperature": 0, "stream": True}
    events = raw_events(server, body)
    names = [name for name, _ in events]
    assert all(name == data["type"] for name, data in events)
    deltas = len(names) - 6
    assert deltas >= 1, names
    assert names == ["message_start", "ping", "content_block_start"] + ["content_block_delta"] * deltas + [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0][1]["message"]
    assert (start["content"], start["stop_reason"], start["usage"]["output_tokens"]) == ([], None, 0)
    assert events[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert {d["delta"]["type"] for _, d in events[3:-3]} == {"text_delta"}
    assert events[-2][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert events[-2][1]["usage"]["output_tokens"] == 5


def assert_anthropic_error(error: anthropic.APIStatusError, kind: str, *words: str) -> None:
    body = error.body
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert body["error"]["type"] == kind and set(body["error"]) == {"type", "message"}, body
    assert all(word in body["error"]["message"] for word in words), body


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"temperature": 1.5}, ["temperature"]),
        ({"top_k": -1}, ["top_k"]),
        ({"messages": [{"role": "system", "content": "Hi"}]}, ["messages.0", "role"]),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, ["thinking", "not supported"]),
        ({"extra_body": {"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}}, ["mcp_servers"]),
        ({"extra_body": {"container": "c1"}}, ["container", "not supported"]),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "u"}}]}]},
            ["messages.0.content.0.type", "image"],
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "document"}]}],
                    }
                ]
            },
            ["messages.0.content.0.content.0.type", "document"],
        ),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, ["tools.0.type", "web_search_20250305"]),
        ({"tool_choice": {"type": "any"}}, ["tool_choice", "needs tools"]),
        ({"tools": [{"name": "f", "input_schema": {"type": "array"}}]}, ["tools.0.input_schema", "object"]),
        (
            {
                "messages": TURNS
                + [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]
            },
            ["messages.3", "tool_result"],
        ),
    ],
    ids=lambda v: json.dumps(v)[:40] if isinstance(v, dict) else None,
)
def test_bad_or_unsupported_fields_are_400s_in_anthropics_shape_naming_them(server, kw, words):
    with pytest.raises(anthropic.BadRequestError) as e:
        create(server, **kw)
    assert_anthropic_error(e.value, "invalid_request_error", *words)


def test_neutral_values_and_cache_control_are_accepted(server):
    plain = create(server, max_tokens=4)
    cached = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    same = create(
        server, max_tokens=4, system=cached, thinking={"type": "disabled"}, metadata={"user_id": "u"}, top_k=0
    )
    assert text_of(same) == text_of(plain)


def test_unknown_model_is_a_404_in_anthropics_shape(server):
    with pytest.raises(anthropic.NotFoundError) as e:
        create(server, model="claude-nope")
    assert_anthropic_error(e.value, "not_found_error", "claude-nope")
    with pytest.raises(anthropic.NotFoundError):
        sdk(server).messages.count_tokens(model="claude-nope", messages=TURNS)


def test_missing_max_tokens_is_a_400_naming_it(server):
    response = httpx.post(f"{server.url}/v1/messages", json={"model": MODEL_NAME, "messages": TURNS}, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"] == {"type": "invalid_request_error", "message": "max_tokens: Field required"}


def test_a_wrong_key_is_an_authentication_error_and_the_right_one_passes(keyed_server):
    with pytest.raises(anthropic.AuthenticationError) as e:
        sdk(keyed_server).with_options(api_key="wrong").messages.create(model=MODEL_NAME, messages=TURNS, max_tokens=2)
    assert_anthropic_error(e.value, "authentication_error", "API key")
    message = anthropic.Anthropic(base_url=keyed_server.url, api_key=API_KEY, max_retries=0).messages.create(
        model=MODEL_NAME, messages=TURNS, max_tokens=2
    )
    assert message.usage.output_tokens == 2


def test_blocks_become_openai_chat_messages():
    body = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 1,
            "system": [{"type": "text", "text": "S"}],
            "messages": [
                {"role": "user", "content": "Q"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "Let me look."},
                        {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"x": 1}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "2"}]},
                        {"type": "tool_result", "tool_use_id": "toolu_2", "content": "no", "is_error": True},
                        {"type": "text", "text": "Go on."},
                    ],
                },
            ],
            "tools": [{"name": "f", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "tool", "name": "f", "disable_parallel_tool_use": True},
        }
    )
    call = {"id": "toolu_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    assert body.conversation() == (
        [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "Q"},
            {"role": "assistant", "content": "Let me look.", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "2"},
            {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no"},
            {"role": "user", "content": "Go on."},
        ],
        False,
    )
    tools = body.tool_calling()
    assert (tools.choice, tools.parallel, [f.name for f in tools.functions]) == ("f", False, ["f"])
    assert body.model_copy(update={"tool_choice": None}).tool_calling().choice == "auto"  # with tools: auto


# On the default model: the tiny one's 256-token context cannot hold the tools' listing.
TOOLS = [
    {"name": "get_weather", "description": "the weather in a city", "input_schema": WEATHER},
    {"name": "count", "description": "count things", "input_schema": COUNT},
]
SCHEMA_OF = {t["name"]: t["input_schema"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def ask(server, **kw) -> anthropic.types.Message:
    kw = {"model": MODEL_NAME, "messages": ASK, "tools": TOOLS, "max_tokens": 80, "temperature": 0} | kw
    return sdk(server).messages.create(**sampled(kw))


def tool_uses(message: anthropic.types.Message) -> list:
    return [b for b in message.content if b.type == "tool_use"]


@pytest.mark.real_model
@pytest.mark.parametrize(
    "choice, names",
    [
        ({"type": "tool", "name": "count"}, {"count"}),
        # one call (greedy, parallel calls repeat until max_tokens)
        ({"type": "any", "disable_parallel_tool_use": True}, {"get_weather", "count"}),
    ],
    ids=["tool", "any"],
)
def test_a_forced_tool_call_has_input_that_validates(real_server, choice, names):
    message = ask(real_server, tool_choice=choice)
    assert message.stop_reason == "tool_use" and len(tool_uses(message)) == 1, message
    for block in tool_uses(message):
        assert block.id.startswith("toolu_") and block.name in names
        jsonschema.validate(block.input, SCHEMA_OF[block.name])
    count = sdk(real_server).messages.count_tokens(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice=choice)
    assert count.input_tokens == input_tokens(message.usage)


@pytest.mark.real_model
def test_a_streamed_tool_call_is_the_message_and_its_json_pieces_join_to_the_input(real_server):
    choice = {"type": "any", "disable_parallel_tool_use": True}
    whole = ask(real_server, tool_choice=choice)
    pieces: list[str] = []
    with sdk(real_server).messages.stream(
        model=MODEL_NAME, messages=ASK, tools=TOOLS, max_tokens=80, tool_choice=choice, extra_body={"temperature": 0}
    ) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                pieces.append(event.delta.partial_json)
        final = stream.get_final_message()
    assert len(tool_uses(whole)) == 1 and final.stop_reason == whole.stop_reason == "tool_use"
    assert json.loads("".join(pieces)) == tool_uses(final)[0].input == tool_uses(whole)[0].input
    assert tool_uses(final)[0].name == tool_uses(whole)[0].name


@pytest.mark.real_model
def test_a_tool_round_trip_reads_the_result_as_openai_chat_does(real_server):
    call = tool_uses(ask(real_server, tool_choice={"type": "tool", "name": "count"}))[0]
    turns = ASK + [
        {"role": "assistant", "content": [call.model_dump(exclude_none=True)]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": '{"n": 3}'}]},
    ]
    reply = ask(real_server, messages=turns, tool_choice={"type": "none"}, max_tokens=24)
    assert reply.stop_reason in ("end_turn", "max_tokens") and not tool_uses(reply)
    arguments = json.dumps(call.input)
    openai_turns = ASK + [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": '{"n": 3}'},
    ]
    openai_tools = [
        {
            "type": "function",
            "function": {"name": t["name"], "description": t["description"], "parameters": t["input_schema"]},
        }
        for t in TOOLS
    ]
    completion = real_server.client().chat.completions.create(
        model=MODEL_NAME, messages=openai_turns, tools=openai_tools, tool_choice="none", max_tokens=24, temperature=0
    )
    assert text_of(reply) == completion.choices[0].message.content
    assert input_tokens(reply.usage) == completion.usage.prompt_tokens
