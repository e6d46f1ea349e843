"""Admission does every per-request check before anything reaches the engine: huge n, seeds outside 64 bits,
lone surrogates and lax types are 400s naming their field, at once, and leave the server and the requests in
flight untouched. The findings of the robustness campaign (issue 13), one test each."""

from __future__ import annotations

import json
import threading
import time
from http.client import HTTPConnection

import pytest

from tests.server.conftest import server_pid_rss_mb
from tests.server.openai_errors import BAD_REQUESTS, assert_openai_error, assert_still_serves, post

HI = [{"role": "user", "content": "Hi"}]
# What a request that reaches the engine adds to, in /metrics.
ADMITTED = (
    "tokenloop_prompt_tokens_total",
    "tokenloop_time_to_first_token_seconds_count",
    "tokenloop_e2e_request_latency_seconds_count",
)


@pytest.fixture(scope="module")
def http(server):
    with server.http() as h:
        yield h


@pytest.mark.parametrize("n", [10**30, 10000, 129])
@pytest.mark.parametrize("route, body", [("completions", {"prompt": "Hi"}), ("chat/completions", {"messages": HI})])
def test_a_huge_n_is_a_400_at_once(server, http, route, body, n):
    before = server.metrics()
    error = assert_openai_error(post(http, route, body | {"max_tokens": 4, "n": n}), 400, "n")
    after = server.metrics()
    assert "128" in error["message"]
    # At once: refused at admission, before anything reached the engine (no prompt token taken in, no request
    # begun or ended there), whatever the machine's speed.
    for name in ADMITTED:
        assert after[name] == before[name], name
    assert_still_serves(http)


def test_best_of_beyond_max_n_or_below_n_is_a_400(http):
    assert_openai_error(post(http, "completions", {"prompt": "Hi", "best_of": 10**6}), 400, "best_of")
    assert_openai_error(post(http, "completions", {"prompt": "Hi", "n": 3, "best_of": 2}), 400, "best_of")


def test_best_of_returns_the_n_most_likely_of_best_of_completions(http):
    body = {"prompt": "Hello", "max_tokens": 6, "temperature": 1.0, "seed": 9, "ignore_eos": True}
    every = post(http, "completions", body | {"n": 4, "logprobs": 0}).json()["choices"]
    ranked = sorted(every, key=lambda c: -sum(c["logprobs"]["token_logprobs"]))
    best = post(http, "completions", body | {"n": 2, "best_of": 4}).json()["choices"]
    assert [c["index"] for c in best] == [0, 1]
    assert [c["text"] for c in best] == [c["text"] for c in ranked[:2]]
    streamed = [
        json.loads(line[6:])
        for line in http.post("/v1/completions", json=body | {"n": 2, "best_of": 4, "stream": True}).text.splitlines()
        if line.startswith("data: {")
    ]
    assert sorted((c["choices"][0]["index"], c["choices"][0]["text"]) for c in streamed) == [
        (0, best[0]["text"]),
        (1, best[1]["text"]),
    ]


def test_a_seed_beyond_64_bits_with_n_2_is_a_400_and_a_request_in_flight_completes_as_alone(server, http):
    body = {"prompt": "Hello world", "max_tokens": 120, "temperature": 0, "ignore_eos": True}
    alone = post(http, "completions", body).json()["choices"][0]["text"]
    result = {}

    def long_request():
        with server.http() as other:
            result["response"] = other.post("/v1/completions", json=body)

    thread = threading.Thread(target=long_request)
    thread.start()
    time.sleep(0.3)  # in flight
    bad = {"prompt": "Hi", "max_tokens": 4, "seed": 2**64 - 1, "n": 2}
    assert_openai_error(post(http, "completions", bad), 400, "seed")
    thread.join(60)
    assert result["response"].status_code == 200 and result["response"].json()["choices"][0]["text"] == alone


@pytest.mark.parametrize("seed", [2**64, 2**63, -(2**63) - 1])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route, body", [("completions", {"prompt": "Hi"}), ("chat/completions", {"messages": HI})])
def test_out_of_range_seeds_are_a_400_streamed_or_not(http, route, body, seed, stream):
    assert_openai_error(post(http, route, body | {"max_tokens": 2, "seed": seed, "stream": stream}), 400, "seed")


def test_the_64_bit_seed_bounds_themselves_are_served(http):
    for seed in (2**63 - 1, -(2**63)):
        response = post(http, "completions", {"prompt": "Hi", "max_tokens": 2, "temperature": 1, "seed": seed, "n": 2})
        assert response.status_code == 200 and len(response.json()["choices"]) == 2


SURROGATES = {
    "prompt": ("completions", b'{"prompt": "Hi \\ud800", "max_tokens": 4}', "prompt"),
    "prompt low surrogate": ("completions", b'{"prompt": "Hi \\udfff", "max_tokens": 4}', "prompt"),
    "prompt in a list": ("completions", b'{"prompt": ["ok", "Hi \\ud800"], "max_tokens": 4}', "prompt"),
    "streamed": ("completions", b'{"prompt": "Hi \\ud800", "max_tokens": 4, "stream": true}', "prompt"),
    "chat content": ("chat/completions", b'{"messages": [{"role": "user", "content": "Hi \\ud800"}]}', "messages"),
    "chat text part": (
        "chat/completions",
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
        "messages",
    ),
    "chat extra field": (
        "chat/completions",
        b'{"messages": [{"role": "user", "content": "Hi", "name": "\\ud800"}]}',
        "messages",
    ),
    "stop": ("completions", b'{"prompt": "Hi", "stop": ["\\ud800"]}', "stop"),
    "model": ("completions", b'{"prompt": "Hi", "model": "\\ud800"}', "model"),
    "a key": ("completions", b'{"prompt": "Hi", "\\ud800": 1}', None),
}


@pytest.mark.parametrize("route, raw, param", SURROGATES.values(), ids=SURROGATES.keys())
def test_lone_surrogates_are_a_400_naming_the_field(http, route, raw, param):
    error = assert_openai_error(post(http, route, raw), 400, param)
    assert "surrogate" in error["message"]
    assert_still_serves(http)


@pytest.mark.parametrize(
    "raw",
    [b'{"prompt": "Hi \xed\xa0\x80", "max_tokens": 4}', b'{"prompt": "\xff\xfe", "max_tokens": 4}'],
    ids=["CESU-8 surrogate", "not UTF-8"],
)
def test_bytes_that_are_not_utf8_are_a_400(http, raw):
    assert_openai_error(post(http, "completions", raw), 400)


LAX = {
    "token false": ("completions", {"prompt": [[False]]}, "prompt"),
    "token true": ("completions", {"prompt": [True, 5]}, "prompt"),
    "max_tokens true": ("completions", {"prompt": "Hi", "max_tokens": True}, "max_tokens"),
    "n true": ("completions", {"prompt": "Hi", "n": True}, "n"),
    "temperature 1e30": ("completions", {"prompt": "Hi", "temperature": 1e30}, "temperature"),
    "chat temperature 1e30": ("chat/completions", {"messages": HI, "temperature": 1e30}, "temperature"),
    "text part not a string": (
        "chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": {"a": 1}}]}]},
        "messages",
    ),
    "image part": (
        "chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages",
    ),
    "stream 1": ("completions", {"prompt": "Hi", "stream": 1}, "stream"),
    "stop a list of numbers": ("completions", {"prompt": "Hi", "stop": [1]}, "stop"),
    "max_tokens 10^9": ("completions", {"prompt": "Hi", "max_tokens": 10**9}, "max_tokens"),
    "chat max_tokens 10^9": ("chat/completions", {"messages": HI, "max_tokens": 10**9}, "max_tokens"),
    "tools on completions": (
        "completions",
        {"prompt": "Hi", "tools": [{"type": "function", "function": {"name": "f"}}]},
        "tools",
    ),
    "tool name with a space": (
        "chat/completions",
        {"messages": HI, "tools": [{"type": "function", "function": {"name": "a b"}}]},
        "tools",
    ),
    "audio output": ("chat/completions", {"messages": HI, "modalities": ["text", "audio"]}, "modalities"),
    "response_format of an unknown type": (
        "chat/completions",
        {"messages": HI, "response_format": {"type": "yaml"}},
        "response_format",
    ),
    "logit_bias above 100": ("completions", {"prompt": "Hi", "logit_bias": {"5": 101}}, "logit_bias"),
    "logit_bias key not a token id": ("completions", {"prompt": "Hi", "logit_bias": {"a": 1}}, "logit_bias"),
    "logit_bias token outside the vocabulary": (
        "chat/completions",
        {"messages": HI, "logit_bias": {"99999999": 1}},
        "logit_bias",
    ),
    "presence_penalty 2.5": ("completions", {"prompt": "Hi", "presence_penalty": 2.5}, "presence_penalty"),
    "repetition_penalty 0": ("completions", {"prompt": "Hi", "repetition_penalty": 0}, "repetition_penalty"),
    "min_tokens above max_tokens": ("completions", {"prompt": "Hi", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    "allowed_token_ids outside the vocabulary": (
        "completions",
        {"prompt": "Hi", "allowed_token_ids": [99999999]},
        "allowed_token_ids",
    ),
    "bad_words blank": ("completions", {"prompt": "Hi", "bad_words": [" "]}, "bad_words"),
}


@pytest.mark.parametrize("route, body, param", LAX.values(), ids=LAX.keys())
def test_lax_inputs_are_a_400_naming_the_field(http, route, body, param):
    assert_openai_error(post(http, route, body), 400, param)


@pytest.mark.parametrize("literal", ["Infinity", "-Infinity", "NaN"])
def test_non_finite_numbers_are_a_400(http, literal):
    raw = b'{"prompt": "Hi", "temperature": %s}' % literal.encode()
    assert_openai_error(post(http, "completions", raw), 400, "temperature")


def test_whole_floats_are_taken_as_integers_and_neutral_values_of_unbuilt_fields_are_served(http):
    response = post(
        http,
        "completions",
        {"prompt": "Hi", "max_tokens": 3.0, "n": 1.0, "tools": [], "logit_bias": {}, "ignore_eos": True},
    )
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3


def test_logits_processor_fields_are_honoured(http):
    def tokens(route, body):
        response = post(
            http,
            route,
            {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 0, **body}
            if route == "completions"
            else {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": True, **body},
        )
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]  # (token, logprob): byte tokens all read "\ufffd", their logprobs differ
        if route == "completions":
            return list(zip(choice["logprobs"]["tokens"], choice["logprobs"]["token_logprobs"]))
        return [(t["token"], t["logprob"]) for t in choice["logprobs"]["content"]]

    plain = tokens("completions", {"prompt": "Hi"})
    forced = tokens("completions", {"prompt": "Hi", "logit_bias": {"7": 100}})
    assert forced != plain and len({t for t, _ in forced}) == 1  # one token, chosen at every step
    assert len({t for t, _ in tokens("chat/completions", {"messages": HI, "allowed_token_ids": [7]})}) == 1
    two = {"messages": HI, "allowed_token_ids": [7, 9]}
    assert len({t for t, _ in tokens("chat/completions", two)}) == 1  # greedy: the likelier of the two, every time
    assert (
        len({t for t, _ in tokens("chat/completions", two | {"frequency_penalty": 2, "presence_penalty": 2})}) == 2
    )  # repeats cost


def test_a_request_after_an_error_on_the_same_keep_alive_connection_succeeds(server):
    conn = HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        for body in (
            {"prompt": "Hi \ud800"},
            {"prompt": "Hi", "seed": 2**64},
            {"prompt": "Hi", "n": 10**30},
            {"prompt": "Hi", "model": "none"},
        ):
            conn.request("POST", "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
            response = conn.getresponse()
            response.read()
            assert response.status in (400, 404) and not response.will_close
            sock = conn.sock
            conn.request(
                "POST",
                "/v1/completions",
                json.dumps({"prompt": "Hi", "max_tokens": 2}).encode(),
                {"Content-Type": "application/json"},
            )
            ok = conn.getresponse()
            assert ok.status == 200 and json.loads(ok.read())["choices"]
            assert conn.sock is sock  # the same connection, not a new one
    finally:
        conn.close()


def test_405_says_which_methods_are_allowed(http):
    response = http.get("/v1/completions")
    assert_openai_error(response, 405)
    assert response.headers["allow"] == "POST"


def test_health_is_a_small_json_body_and_metrics_are_text(http):
    health = http.get("/health")
    assert (
        health.status_code == 200
        and health.headers["content-type"] == "application/json"
        and health.json() == {"status": "ok"}
    )
    assert http.get("/metrics").headers["content-type"].startswith("text/plain")


def test_the_schema_documents_400_not_422_and_the_servers_bounds(http):
    schema = http.get("/openapi.json").json()
    for path, operations in schema["paths"].items():
        for operation in operations.values():
            assert "422" not in operation["responses"], path
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models"):
        responses = schema["paths"][path]["post" if "completions" in path else "get"]["responses"]
        for status in ("400", "401", "404", "429", "500", "503"):
            assert responses[status]["content"]["application/json"]["schema"] == {
                "$ref": "#/components/schemas/ErrorResponse"
            }, (path, status)
    assert "text/plain" in schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert schema["paths"]["/health"]["get"]["responses"]["503"]
    request = schema["components"]["schemas"]["CompletionRequest"]
    assert request["properties"]["n"]["maximum"] == 128
    assert "HTTPValidationError" not in schema["components"]["schemas"]


def test_2000_bad_requests_leave_memory_where_100_left_it(server, http):
    bodies = [(route, body) for route, body, _ in BAD_REQUESTS.values()] + [
        (route, raw) for route, raw, _ in SURROGATES.values()
    ]
    bodies += [(route, body) for route, body, _ in LAX.values()] + [
        ("completions", {"prompt": "Hi", "n": 10**30}),
        ("completions", {"prompt": "Hi", "seed": 2**64, "n": 2}),
    ]
    after_100 = None
    for i in range(2000):
        route, body = bodies[i % len(bodies)]
        assert post(http, route, body).status_code in (400, 404)
        if i == 99:
            after_100 = server_pid_rss_mb(server)
    assert server_pid_rss_mb(server) <= after_100 * 1.10
    assert_still_serves(http)
