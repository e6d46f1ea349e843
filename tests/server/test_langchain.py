"""A third-party client unchanged: langchain-openai's ChatOpenAI pointed at the server (the default model), with
.with_structured_output(a pydantic model) and .bind_tools([...])."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, Field

from tests.server.conftest import MODEL_NAME

langchain_openai = pytest.importorskip("langchain_openai")


class City(BaseModel):
    """A city and the country it is in."""

    name: str = Field(max_length=30)
    country: str = Field(max_length=30)


class GetWeather(BaseModel):
    """Get the current weather in a city."""

    city: str = Field(max_length=30)
    unit: str = Field(pattern="^(celsius|fahrenheit)$")


def chat_model(real_server, **kw):
    return langchain_openai.ChatOpenAI(
        base_url=f"{real_server.url}/v1",
        api_key="unused",
        model=MODEL_NAME,
        temperature=0,
        max_tokens=200,
        max_retries=0,
        **kw,
    )


def test_with_structured_output_returns_the_pydantic_model(real_server):
    city = chat_model(real_server).with_structured_output(City).invoke("Name a city in France.")
    assert isinstance(city, City) and city.name and city.country


def test_bind_tools_returns_a_parsed_tool_call(real_server):
    message = (
        chat_model(real_server)
        .bind_tools([GetWeather], tool_choice="GetWeather")
        .invoke("What is the weather in Paris?")
    )
    (call,) = message.tool_calls
    assert call["name"] == "GetWeather"
    GetWeather(**call["args"])  # validates
    assert message.response_metadata["finish_reason"] == "tool_calls"


def test_streamed_tool_calls_reassemble_in_langchain(real_server):
    model = chat_model(real_server).bind_tools([GetWeather], tool_choice="GetWeather")
    chunks = list(model.stream("What is the weather in Paris?"))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged += chunk
    (call,) = merged.tool_calls
    assert call["name"] == "GetWeather" and GetWeather(**call["args"])
