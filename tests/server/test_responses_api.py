"""The Responses API (POST /v1/responses) through the `openai` client, unchanged: a translation onto chat's one path, so
greedy and seeded replies and their usage equal /v1/chat/completions on the same conversation; streamed events come
in the SDK's order with sequence numbers from 0 and add up to the non-streamed response; stored responses continue
with previous_response_id (without their instructions); unsupported fields are 400s naming the field. On the default
model: parse() with a pydantic model, a required function tool and its output in the next turn, and the OpenAI Agents
SDK running an agent with one tool.

The tiny model writes bytes at random; the inputs below are ones whose greedy reply stops within the limit."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.server.conftest import MODEL_NAME

# Greedy on the tiny model: "a" stops after 10 tokens, "red" after "Be brief" after 35.
STOPS, STOPS_WITH_INSTRUCTIONS, BRIEF = "a", "red", "Be brief"
IGNORED = {"id", "created_at"}  # differ between two requests for the same reply


def chat(client, messages: list[dict], **kw):
    return client.chat.completions.create(model=MODEL_NAME, messages=messages, **kw)


def wire(response) -> dict:
    """A response as sent, less what differs between two runs of the same request: ids, and how much of the input
    the prefix cache served."""
    body = response.model_dump(mode="json", exclude_none=True, exclude=IGNORED)
    body["usage"].pop("input_tokens_details")
    for item in body["output"]:
        item.pop("id")
        item.pop("call_id", None)
    return body


def test_string_input_with_instructions_is_chats_system_then_user_message(client):
    r = client.responses.create(
        model=MODEL_NAME, input=STOPS_WITH_INSTRUCTIONS, instructions=BRIEF, max_output_tokens=60, temperature=0
    )
    c = chat(
        client,
        [{"role": "system", "content": BRIEF}, {"role": "user", "content": STOPS_WITH_INSTRUCTIONS}],
        max_tokens=60,
        temperature=0,
    )
    assert c.choices[0].finish_reason == "stop"
    assert r.status == "completed" and r.incomplete_details is None and r.object == "response"
    assert r.id.startswith("resp_") and r.model == MODEL_NAME and r.instructions == BRIEF
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert message.id.startswith("msg_") and [p.type for p in message.content] == ["output_text"]
    assert r.output_text == c.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == (c.usage.prompt_tokens, c.usage.completion_tokens)
    assert r.usage.total_tokens == c.usage.total_tokens
    assert r.usage.input_tokens_details.cached_tokens == c.usage.prompt_tokens_details.cached_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0


def test_item_input_equals_chat_and_max_output_tokens_makes_it_incomplete(client, server):
    items = [
        {"role": "developer", "content": "Short answers."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Hello", "annotations": []}],
        },
        {"role": "user", "content": [{"type": "input_text", "text": "two "}, {"type": "input_text", "text": "parts"}]},
    ]
    messages = [
        {"role": "developer", "content": "Short answers."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "two parts"},
    ]
    r = client.responses.create(model=MODEL_NAME, input=items, max_output_tokens=5, temperature=0)
    c = chat(client, messages, max_tokens=5, temperature=0)
    assert c.choices[0].finish_reason == "length"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete"
    assert r.output_text == c.choices[0].message.content
    with server.http() as http:
        tokens = http.post("/tokenize", json={"model": MODEL_NAME, "messages": messages}).json()
    assert (r.usage.input_tokens, r.usage.output_tokens) == (tokens["count"], 5)


def test_seeded_sample_equals_chat_with_the_same_seed(client):
    sampled = {"temperature": 1.0, "top_p": 0.9, "extra_body": {"seed": 1234, "top_k": 50}}
    r = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=12, **sampled)
    c = chat(client, [{"role": "user", "content": "Hi"}], max_tokens=12, **sampled)
    greedy = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=12, temperature=0)
    assert r.output_text == c.choices[0].message.content != greedy.output_text


SMALL = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
FORMATS = {  # text.format -> chat's response_format
    "json_object": ({"type": "json_object"}, {"type": "json_object"}),
    "json_schema": (
        {"type": "json_schema", "name": "small", "schema": SMALL, "strict": True},
        {"type": "json_schema", "json_schema": {"name": "small", "schema": SMALL, "strict": True}},
    ),
}


@pytest.mark.parametrize("kind", sorted(FORMATS))
def test_text_format_constrains_as_chats_response_format_does(client, kind):
    text_format, response_format = FORMATS[kind]
    r = client.responses.create(
        model=MODEL_NAME, input="Hi", max_output_tokens=24, temperature=0, text={"format": text_format}
    )
    c = chat(client, [{"role": "user", "content": "Hi"}], max_tokens=24, temperature=0, response_format=response_format)
    assert r.output_text == c.choices[0].message.content and r.output_text.startswith("{")
    assert r.text.format.type == kind


def test_stream_sends_the_sdks_events_in_order_and_ends_with_the_non_streamed_response(client):
    kw = {"model": MODEL_NAME, "input": STOPS, "max_output_tokens": 60, "temperature": 0}
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    plain = client.responses.create(**kw)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1 and kinds == [  # outputs may arrive several tokens at a time
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == plain.output_text
    assert wire(final) == wire(plain) and final.id == events[0].response.id
    assert wire(client.responses.retrieve(final.id)) == wire(final)


def test_stream_cut_by_max_output_tokens_ends_with_response_incomplete(client):
    with client.responses.stream(model=MODEL_NAME, input="Hi", max_output_tokens=4, temperature=0) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.usage.output_tokens == 4


def test_previous_response_id_continues_the_conversation_without_its_instructions(client):
    first = client.responses.create(
        model=MODEL_NAME, input="Hi", instructions=BRIEF, max_output_tokens=6, temperature=0
    )
    second = client.responses.create(
        model=MODEL_NAME, input="red", previous_response_id=first.id, max_output_tokens=6, temperature=0
    )
    conversation = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "red"},
    ]
    c = chat(client, conversation, max_tokens=6, temperature=0)
    assert second.previous_response_id == first.id and second.instructions is None
    assert second.output_text == c.choices[0].message.content
    assert second.usage.input_tokens == c.usage.prompt_tokens
    # and a third turn on top of the second: the chain resolves through the second's own previous_response_id
    third = client.responses.create(
        model=MODEL_NAME, input="go", previous_response_id=second.id, max_output_tokens=6, temperature=0
    )
    c3 = chat(
        client,
        conversation + [{"role": "assistant", "content": second.output_text}, {"role": "user", "content": "go"}],
        max_tokens=6,
        temperature=0,
    )
    assert third.output_text == c3.choices[0].message.content
    assert wire(client.responses.retrieve(first.id)) == wire(first)


def test_store_false_is_not_kept_and_unknown_ids_are_404(client):
    r = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=2, temperature=0, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=2, previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=2, previous_response_id="resp_none")
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_none")


UNSUPPORTED = {
    "background": {"background": True},
    "reasoning": {"reasoning": {"effort": "high"}},
    "include": {"include": ["message.output_text.logprobs"]},
    "truncation": {"truncation": "auto"},
    "top_logprobs": {"top_logprobs": 2},
    "conversation": {"conversation": "conv_1"},
    "prompt": {"prompt": {"id": "pmpt_1"}},
    "max_tool_calls": {"max_tool_calls": 1},
    "tools": {"tools": [{"type": "web_search"}]},
    "text": {"text": {"verbosity": "high"}},
}


@pytest.mark.parametrize("field", sorted(UNSUPPORTED))
def test_a_result_changing_field_not_supported_is_a_400_naming_it(client, field):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=2, extra_body=UNSUPPORTED[field])
    assert e.value.body["param"] == field, e.value.body


def test_neutral_values_of_unsupported_fields_are_accepted(client):
    neutral = {
        "background": False,
        "include": [],
        "truncation": "disabled",
        "top_logprobs": 0,
        "reasoning": None,
        "conversation": None,
        "metadata": {"k": "v"},
        "user": "u",
        "parallel_tool_calls": True,
        "service_tier": "auto",
        "text": {"format": {"type": "text"}},
    }
    r = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=2, temperature=0, extra_body=neutral)
    assert r.usage.output_tokens == 2 and r.metadata == {"k": "v"}


def test_bad_values_name_the_responses_field(client):
    cases = {
        "max_output_tokens": {"max_output_tokens": 1000},  # beyond the 256-token context
        "input": {"input": [{"role": "tool", "content": "x"}]},
        "temperature": {"temperature": 3},
        "text.format": {  # a lookbehind: no grammar can honour it
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "string", "pattern": "(?<=a)b"}}}
        },
        "tool_choice": {"tool_choice": {"type": "function", "name": "f"}, "tools": [{"type": "function", "name": "g"}]},
    }
    for field, body in cases.items():
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(**{"model": MODEL_NAME, "input": "Hi"} | body)
        assert e.value.body["param"] == field, e.value.body


# The default model: what a random one cannot show.

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "pattern": "^[A-Za-z]{1,8}$"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}]
ASK = "What is the weather in Paris?"


class Person(BaseModel):
    name: str
    age: int


def test_parse_with_a_pydantic_model_gives_an_instance(real_client):
    r = real_client.responses.parse(
        model=MODEL_NAME,
        input="Alice is 30. Give her as JSON.",
        text_format=Person,
        temperature=0,
        max_output_tokens=60,
    )
    assert r.status == "completed"
    assert isinstance(r.output_parsed, Person)
    assert r.output_parsed == Person.model_validate_json(r.output_text)


def test_required_function_tool_then_its_output_gives_a_text_reply(real_client):
    kw = {"model": MODEL_NAME, "tools": TOOLS, "temperature": 0, "max_output_tokens": 100}
    r = real_client.responses.create(input=ASK, tool_choice="required", parallel_tool_calls=False, **kw)
    assert r.status == "completed"
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    with real_client.responses.stream(input=ASK, tool_choice="required", parallel_tool_calls=False, **kw) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert wire(final) == wire(r)
    assert kinds[2:4] == ["response.output_item.added", "response.function_call_arguments.delta"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"celsius": 21})}
    reply = real_client.responses.create(input=[result], previous_response_id=r.id, **kw)
    assert [item.type for item in reply.output] == ["message"] and reply.output_text


def test_agents_sdk_runs_an_agent_with_one_function_tool(real_server):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    cities = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        cities.append(city)
        return f"It is sunny and 21 degrees in {city}."

    client = AsyncOpenAI(base_url=f"{real_server.url}/v1", api_key="x", max_retries=0)
    model = agents.OpenAIResponsesModel(model=MODEL_NAME, openai_client=client)
    settings = agents.ModelSettings(tool_choice="required", temperature=0, parallel_tool_calls=False, max_tokens=100)
    agent = agents.Agent(
        name="weather",
        instructions="Answer about the weather.",
        tools=[get_weather],
        model=model,
        model_settings=settings,
    )

    async def run():
        plain = await agents.Runner.run(agent, ASK, max_turns=4)
        streamed = agents.Runner.run_streamed(agent, ASK, max_turns=4)
        async for _ in streamed.stream_events():
            pass
        return plain, streamed

    plain, streamed = asyncio.run(run())
    assert cities == ["Paris", "Paris"]
    assert [item.type for item in plain.new_items] == ["tool_call_item", "tool_call_output_item", "message_output_item"]
    assert isinstance(plain.final_output, str) and plain.final_output
    assert streamed.final_output == plain.final_output


def test_the_store_evicts_the_least_recently_used_response():
    from tokenloop.server.response_store import ResponseStore, StoredResponse

    store = ResponseStore(capacity=2)
    for name in ("a", "b"):
        store.put(name, StoredResponse({"id": name}, []))
    assert store.get("a") is not None  # a is now the most recently used
    store.put("c", StoredResponse({"id": "c"}, []))
    assert [store.get(name) is not None for name in ("a", "b", "c")] == [True, False, True] and len(store) == 2
