"""`tokenloop serve --lora NAME=DIR`: adapters served by model name beside the base model, through every API (OpenAI's
completions, chat and responses, Anthropic's messages); listed by /v1/models; any other name a 404 in its API's
error shape."""

from __future__ import annotations

import asyncio

import anthropic
import httpx
import pytest

from tests.server.conftest import MODEL_NAME, start_server, stop_server
from tests.server.openai_errors import HI, assert_openai_error
from tests.server.test_anthropic_messages import assert_anthropic_error, sdk
from tokenloop import LLM, SamplingParams

PROMPT = "Hello world! Hello tokenizers, hello templates. The quick brown fox"
TOKENS = 12


@pytest.fixture(scope="module")
def lora_server(tiny_model_folder, tiny_lora, tmp_path_factory):
    adapter, _ = tiny_lora
    s = start_server(
        tiny_model_folder, tmp_path_factory.mktemp("lora_server") / "server.log", "--lora", f"tuned={adapter}"
    )
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def expected(tiny_model_folder, tiny_lora) -> dict[str, str]:
    """Greedy completions of PROMPT: the base model's, and the merged model's (the adapter's reference)."""
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    return {
        name: LLM(folder, dtype="float32", device="cpu", kv_cache_gb=0.01)
        .generate(PROMPT, params, use_tqdm=False)[0]
        .outputs[0]
        .text
        for name, folder in ((MODEL_NAME, tiny_model_folder), ("tuned", tiny_lora[1]))
    }


def test_models_lists_the_adapters_with_the_base_model_as_parent(lora_server, tiny_lora):
    models = lora_server.client().models.list().data
    assert [m.id for m in models] == [MODEL_NAME, "tuned"]
    assert models[1].parent == MODEL_NAME and models[1].root == str(tiny_lora[0])


def test_completions_by_model_name_get_the_base_or_the_merged_models_text_in_one_batch(lora_server, expected):
    """Both run at once (the same prompt: the prefix cache must keep them apart), each with its own tokens."""
    client = lora_server.async_client()

    async def both():
        return await asyncio.gather(
            *(
                client.completions.create(
                    model=name, prompt=PROMPT, max_tokens=TOKENS, temperature=0, extra_body={"ignore_eos": True}
                )
                for name in (MODEL_NAME, "tuned", MODEL_NAME, "tuned")
            )
        )

    for out in asyncio.run(both()):
        assert out.choices[0].text == expected[out.model]
    assert expected[MODEL_NAME] != expected["tuned"]


def test_chat_responses_and_messages_run_the_adapter_and_name_it(lora_server):
    client = lora_server.client()
    chat = client.chat.completions.create(model="tuned", messages=HI, max_tokens=4, temperature=0)
    assert chat.model == "tuned"
    base = client.chat.completions.create(model=MODEL_NAME, messages=HI, max_tokens=4, temperature=0)
    response = client.responses.create(model="tuned", input="Hi", max_output_tokens=4, temperature=0)
    assert response.model == "tuned" and response.output_text == chat.choices[0].message.content
    messages = sdk(lora_server).messages.create(
        model="tuned", max_tokens=4, messages=[{"role": "user", "content": "Hi"}], extra_body={"temperature": 0}
    )
    assert messages.model == "tuned" and messages.content[0].text == chat.choices[0].message.content
    assert base.choices[0].message.content != chat.choices[0].message.content


def test_an_unknown_adapter_is_a_404_in_each_apis_error_shape(lora_server):
    with httpx.Client(base_url=lora_server.url, timeout=60) as http:
        for route, body in (("completions", {"prompt": "Hi"}), ("chat/completions", {"messages": HI})):
            error = assert_openai_error(http.post(f"/v1/{route}", json=body | {"model": "tuned-nope"}), 404, "model")
            assert "tuned-nope" in error["message"] and "`tuned`" in error["message"]
        assert_openai_error(http.post("/v1/responses", json={"model": "tuned-nope", "input": "Hi"}), 404, "model")
    with pytest.raises(anthropic.NotFoundError) as e:
        sdk(lora_server).messages.create(model="tuned-nope", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert_anthropic_error(e.value, "not_found_error", "tuned-nope")
