"""What the server tests check of an error: OpenAI's error shape, and a table of bad requests with the field each
must name."""

from __future__ import annotations

ANY = object()  # the error's param may be anything (still present)
HI = [{"role": "user", "content": "Hi"}]

# (route, JSON body or raw bytes, expected param)
BAD_REQUESTS = {
    "temperature -1": ("completions", {"prompt": "Hi", "temperature": -1}, "temperature"),
    "top_p 1.5": ("completions", {"prompt": "Hi", "top_p": 1.5}, "top_p"),
    "top_k -2": ("completions", {"prompt": "Hi", "top_k": -2}, "top_k"),
    "max_tokens 0": ("completions", {"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
    "n 0": ("completions", {"prompt": "Hi", "n": 0}, "n"),
    "logprobs 21": ("completions", {"prompt": "Hi", "logprobs": 21}, "logprobs"),
    "chat temperature -1": ("chat/completions", {"messages": HI, "temperature": -1}, "temperature"),
    "chat top_p 1.5": ("chat/completions", {"messages": HI, "top_p": 1.5}, "top_p"),
    "chat max_tokens 0": ("chat/completions", {"messages": HI, "max_tokens": 0}, "max_tokens"),
    "chat n 0": ("chat/completions", {"messages": HI, "n": 0}, "n"),
    "chat top_logprobs 21": (
        "chat/completions",
        {"messages": HI, "logprobs": True, "top_logprobs": 21},
        "top_logprobs",
    ),
    "token id = vocab size": ("completions", {"prompt": [5, 6, 400]}, "prompt"),
    "negative token id": ("completions", {"prompt": [5, -1]}, "prompt"),
    "empty prompt": ("completions", {"prompt": ""}, "prompt"),
    "empty token list": ("completions", {"prompt": []}, "prompt"),
    "one of two prompts empty": ("completions", {"prompt": ["Hi", ""]}, "prompt"),
    "missing prompt": ("completions", {"max_tokens": 2}, "prompt"),
    "message without role": ("chat/completions", {"messages": [{"content": "Hi"}]}, "messages"),
    "message with unknown role": ("chat/completions", {"messages": [{"role": "wizard", "content": "Hi"}]}, "messages"),
    "number as content": ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages"),
    "no messages": ("chat/completions", {"messages": []}, "messages"),
    "messages not a list": ("chat/completions", {"messages": "Hi"}, "messages"),
    "max_tokens a word": ("completions", {"prompt": "Hi", "max_tokens": "many"}, "max_tokens"),
    "temperature a word": ("completions", {"prompt": "Hi", "temperature": "hot"}, "temperature"),
    "n a fraction": ("completions", {"prompt": "Hi", "n": 1.5}, "n"),
    "prompt a number": ("completions", {"prompt": 5}, "prompt"),
    "stop a number": ("completions", {"prompt": "Hi", "stop": 5}, "stop"),
    "chat stream a list": ("chat/completions", {"messages": HI, "stream": [1]}, "stream"),
    "body a list": ("completions", [1, 2], ANY),
    "invalid JSON": ("completions", b'{"prompt": "Hi",', None),
    "empty body": ("completions", b"", ANY),
}


def assert_openai_error(response, status: int, param=ANY) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if param is not ANY:
        assert error["param"] == param, error
    return error


def post(http, route, body):
    if isinstance(body, bytes):
        return http.post(f"/v1/{route}", content=body, headers={"Content-Type": "application/json"})
    return http.post(f"/v1/{route}", json=body)


def assert_still_serves(http):
    ok = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 1
