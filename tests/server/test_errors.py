"""Bad requests get OpenAI's error shape and status (400, 404, 401; never FastAPI's 422), and leave the server
serving."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import API_KEY, MODEL_NAME
from tests.server.openai_errors import BAD_REQUESTS, HI, assert_openai_error, assert_still_serves, post


@pytest.fixture(scope="module")
def http(server):
    with server.http() as h:
        yield h


@pytest.mark.parametrize("route, body, param", BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
def test_bad_request_is_a_400_in_the_openai_error_shape_and_the_server_goes_on(http, route, body, param):
    error = assert_openai_error(post(http, route, body), 400, param)
    assert error["type"] == "invalid_request_error"
    assert_still_serves(http)


def test_bad_streamed_request_is_a_400_before_any_stream_starts(http):
    response = http.post("/v1/chat/completions", json={"messages": HI, "temperature": -1, "stream": True})
    assert_openai_error(response, 400, "temperature")


def test_prompt_longer_than_the_context_names_both_lengths(http):
    error = assert_openai_error(http.post("/v1/completions", json={"prompt": [5] * 300, "max_tokens": 1}), 400)
    assert "300" in error["message"] and "256" in error["message"]
    long_text = "Hello world " * 200
    error = assert_openai_error(
        http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": long_text}]}), 400
    )
    assert "256" in error["message"]
    assert_still_serves(http)


def test_prompt_plus_max_tokens_beyond_the_context_is_a_400(http):
    error = assert_openai_error(http.post("/v1/completions", json={"prompt": [5] * 200, "max_tokens": 100}), 400)
    assert "256" in error["message"]


def test_openai_client_raises_bad_request_with_the_servers_message(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt="Hi", temperature=-1)
    assert e.value.status_code == 400 and "temperature" in e.value.message
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=HI, logprobs=True, top_logprobs=21)


def test_unknown_model_is_a_404(http, client):
    for route, body in (("completions", {"prompt": "Hi"}), ("chat/completions", {"messages": HI})):
        error = assert_openai_error(http.post(f"/v1/{route}", json=body | {"model": "no-such-model"}), 404, "model")
        assert "no-such-model" in error["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="Hi", max_tokens=2)


def test_a_body_over_the_limit_is_a_413_unread_and_the_server_goes_on(server):
    """The default limit is 8 MiB: a 9 MiB prompt declared by Content-Length is refused before its body is read, one
    sent in chunks (no length) as it crosses the limit; a 7 MiB body is read and judged (its prompt is too long)."""
    big = b'{"prompt": "' + b"a" * (9 * 2**20) + b'"}'
    with httpx.Client(base_url=server.url, timeout=60) as http:
        assert_openai_error(
            http.post("/v1/completions", content=big, headers={"Content-Type": "application/json"}), 413
        )
    with httpx.Client(base_url=server.url, timeout=60) as http:
        chunks = (big[i : i + 2**16] for i in range(0, len(big), 2**16))
        error = assert_openai_error(
            http.post("/v1/completions", content=chunks, headers={"Content-Type": "application/json"}), 413
        )
        assert "--max-body-mb" in error["message"]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        fits = b'{"prompt": "' + b"a " * (7 * 2**19) + b'", "max_tokens": 1}'
        assert_openai_error(
            http.post("/v1/completions", content=fits, headers={"Content-Type": "application/json"}), 400, "prompt"
        )
        assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_unknown_route_is_a_404_in_the_openai_error_shape(http):
    assert_openai_error(http.get("/v1/no-such-route"), 404)


def test_missing_or_wrong_api_key_is_a_401_while_health_needs_none(keyed_server):
    with keyed_server.http() as authorized:
        assert authorized.get("/v1/models").status_code == 200
        assert authorized.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
    with httpx.Client(base_url=keyed_server.url, timeout=60) as anonymous:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            assert_openai_error(anonymous.get("/v1/models", headers=headers), 401)
            assert_openai_error(anonymous.post("/v1/completions", json={"prompt": "Hi"}, headers=headers), 401)
        assert anonymous.get("/health").status_code == 200
        assert anonymous.get("/metrics").status_code == 200


def test_openai_client_with_the_api_key_is_served_and_without_it_refused(keyed_server):
    assert [m.id for m in keyed_server.client().models.list().data] == [MODEL_NAME]
    out = keyed_server.client().chat.completions.create(
        model=MODEL_NAME, messages=HI, max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 3
    chunks = list(
        keyed_server.client().completions.create(
            model=MODEL_NAME, prompt="Hi", max_tokens=3, stream=True, extra_body={"ignore_eos": True}
        )
    )
    assert chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.AuthenticationError):
        keyed_server.client(api_key="wrong").models.list()
