"""vLLM's tokenizer routes on the tiny model, against transformers' reading of the same tokenizer: /tokenize (a
prompt, or a conversation through the chat template), /detokenize, /tokenizer_info."""

from __future__ import annotations

import httpx
import pytest

from tests.server.openai_errors import assert_openai_error

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello tokenizers"}]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_tokenize_a_prompt_as_transformers_does(http, hf_tokenizer, add_special_tokens):
    text = "Hello world, tokenizers <s> and all"
    out = http.post(
        "/tokenize", json={"prompt": text, "add_special_tokens": add_special_tokens, "return_token_strs": True}
    ).json()
    expected = hf_tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
    assert out["tokens"] == expected and out["count"] == len(expected) and out["max_model_len"] == 256
    assert out["token_strs"] == hf_tokenizer.convert_ids_to_tokens(expected)
    assert "token_strs" not in http.post("/tokenize", json={"prompt": text}).json()


def test_tokenize_a_conversation_through_the_chat_template(http, hf_tokenizer):
    out = http.post("/tokenize", json={"messages": MESSAGES}).json()
    expected = hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert out["tokens"] == expected["input_ids"] and out["count"] == len(out["tokens"])
    bare = http.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert bare["tokens"] == out["tokens"][: bare["count"]] and bare["count"] < out["count"]


def test_a_prompt_longer_than_the_context_is_tokenized_all_the_same(http, hf_tokenizer):
    text = "one two three four five six seven " * 60
    out = http.post("/tokenize", json={"prompt": text}).json()
    assert out["count"] == len(hf_tokenizer(text)["input_ids"]) > out["max_model_len"]


def test_detokenize_writes_out_the_tokens_and_refuses_ids_outside_the_vocabulary(http, hf_tokenizer):
    ids = hf_tokenizer("Hello world, again")["input_ids"]
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": hf_tokenizer.decode(ids)}
    response = http.post("/detokenize", json={"tokens": [5, 400]})
    assert_openai_error(response, 400, "tokens")
    assert "out of the vocabulary [0, 400)" in response.json()["error"]["message"]


def test_tokenizer_info_gives_the_special_tokens_template_and_context(http, hf_tokenizer):
    info = http.get("/tokenizer_info").json()
    assert (info["eos_token"], info["bos_token"]) == (hf_tokenizer.eos_token, hf_tokenizer.bos_token)
    assert info["chat_template"] == hf_tokenizer.chat_template and info["model_max_length"] == 256


def test_the_tokenizer_routes_answer_for_the_served_model_only_and_check_their_fields(http):
    assert_openai_error(http.post("/tokenize", json={"model": "other", "prompt": "a"}), 404, "model")
    assert_openai_error(http.post("/tokenize", json={"prompt": 5}), 400)
    assert_openai_error(http.post("/detokenize", json={"tokens": [-1]}), 400)
