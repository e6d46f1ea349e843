"""The OpenAI-compatible routes as the real `openai` client sees them: texts, streams, usage, n, logprobs, stop,
seeds, echo and token-id prompts, on the tiny random model (greedy unless a test says otherwise)."""

from __future__ import annotations

import openai
import pytest

from tests.server.conftest import MODEL_NAME

PROMPT = "Hello world"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello tokenizers"}]


def complete(client, prompt=PROMPT, **kw):
    kw = {"max_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}} | kw
    return client.completions.create(model=MODEL_NAME, prompt=prompt, **kw)


def chat(client, messages=MESSAGES, **kw):
    kw = {"max_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}} | kw
    return client.chat.completions.create(model=MODEL_NAME, messages=messages, **kw)


def chat_prompt_ids(hf_tokenizer, messages) -> list[int]:
    return hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"
    ]


def pick_stop(text: str) -> tuple[str, int]:
    """A 2-character stop string that first occurs at position >= 2 of `text` (no U+FFFD, whose bytes may still
    change)."""
    for k in range(2, len(text) - 1):
        stop = text[k : k + 2]
        if "\ufffd" not in stop and stop.strip() and text.find(stop) == k:
            return stop, k
    pytest.fail(f"no usable stop string in {text!r}")


def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].object == "model"


def test_completion_stops_at_max_tokens_with_usage_counted_like_the_tokenizer(client, hf_tokenizer):
    out = complete(client, max_tokens=8)
    assert out.object == "text_completion" and out.model == MODEL_NAME
    assert len(out.choices) == 1 and out.choices[0].index == 0
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(hf_tokenizer.encode(PROMPT))
    assert out.usage.completion_tokens == 8
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8


def test_chat_stops_at_max_tokens_with_usage_counted_like_the_chat_template(client, hf_tokenizer):
    out = chat(client, max_tokens=7)
    assert out.object == "chat.completion" and out.model == MODEL_NAME
    (choice,) = out.choices
    assert choice.index == 0 and choice.message.role == "assistant" and choice.finish_reason == "length"
    assert out.usage.prompt_tokens == len(chat_prompt_ids(hf_tokenizer, MESSAGES))
    assert out.usage.completion_tokens == 7
    assert out.usage.total_tokens == out.usage.prompt_tokens + 7


def test_max_completion_tokens_limits_a_chat_like_max_tokens(client):
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "length"


def test_streamed_completion_joins_to_the_non_streamed_text_and_ends_with_usage(client):
    full = complete(client, max_tokens=12)
    chunks = list(complete(client, max_tokens=12, stream=True, stream_options={"include_usage": True}))
    *text_chunks, usage_chunk = chunks
    assert "".join(c.choices[0].text for c in text_chunks) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks] == [None] * (len(text_chunks) - 1) + ["length"]
    assert all(c.id == chunks[0].id and c.object == "text_completion" for c in chunks)
    assert usage_chunk.choices == []
    assert usage_chunk.usage.prompt_tokens == full.usage.prompt_tokens
    assert usage_chunk.usage.completion_tokens == 12


def test_streamed_chat_joins_to_the_non_streamed_text_and_ends_with_usage(client):
    full = chat(client, max_tokens=12)
    chunks = list(chat(client, max_tokens=12, stream=True, stream_options={"include_usage": True}))
    *deltas, usage_chunk = chunks
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in deltas) == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in deltas] == [None] * (len(deltas) - 1) + ["length"]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert usage_chunk.choices == []
    assert usage_chunk.usage.prompt_tokens == full.usage.prompt_tokens
    assert usage_chunk.usage.completion_tokens == 12


def test_streamed_chat_logprobs_cover_every_token_even_those_that_add_no_text(client):
    # The tiny model emits byte tokens: a partial UTF-8 character adds no text until the character completes.
    full = chat(client, max_tokens=24, logprobs=True, top_logprobs=2)
    chunks = list(chat(client, max_tokens=24, logprobs=True, top_logprobs=2, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert len(full.choices[0].logprobs.content) == full.usage.completion_tokens == 24
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in full.choices[0].logprobs.content]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content


def test_stream_without_include_usage_sends_no_usage_chunk(client):
    chunks = list(complete(client, max_tokens=4, stream=True))
    assert all(c.choices and c.usage is None for c in chunks)


def test_stop_string_from_a_greedy_output_cuts_the_completion_before_it(client):
    text = complete(client, max_tokens=24).choices[0].text
    stop, k = pick_stop(text)
    out = complete(client, max_tokens=24, stop=[stop])
    assert out.choices[0].text == text[:k]
    assert out.choices[0].finish_reason == "stop"
    streamed = list(complete(client, max_tokens=24, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == text[:k]
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_stop_string_from_a_greedy_output_cuts_the_chat_reply_before_it(client):
    text = chat(client, max_tokens=24).choices[0].message.content
    stop, k = pick_stop(text)
    out = chat(client, max_tokens=24, stop=[stop])
    assert out.choices[0].message.content == text[:k]
    assert out.choices[0].finish_reason == "stop"


def test_n_2_gives_two_choices_indexed_0_and_1(client):
    out = complete(client, n=2, temperature=1, seed=3, max_tokens=6)
    assert [c.index for c in out.choices] == [0, 1]
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage.completion_tokens == 12
    out = chat(client, n=2, temperature=1, seed=3, max_tokens=6)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.completion_tokens == 12


def test_streamed_n_2_chat_gives_each_choice_its_text_and_one_finish(client):
    full = chat(client, n=2, temperature=1, seed=5, max_tokens=10)
    chunks = list(chat(client, n=2, temperature=1, seed=5, max_tokens=10, stream=True))
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == index]
        assert "".join(c.delta.content or "" for c in mine) == full.choices[index].message.content
        assert [c.finish_reason for c in mine if c.finish_reason] == ["length"]


def test_streamed_n_2_completion_gives_each_choice_its_text_and_one_finish(client):
    full = complete(client, n=2, temperature=1, seed=5, max_tokens=10)
    chunks = list(complete(client, n=2, temperature=1, seed=5, max_tokens=10, stream=True))
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == index]
        assert "".join(c.text for c in mine) == full.choices[index].text
        assert [c.finish_reason for c in mine if c.finish_reason] == ["length"]


def test_completion_logprobs_give_each_token_its_logprob_and_the_top_3(client):
    out = complete(client, max_tokens=6, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        # Keyed by decoded text: tokens that decode alike (partial UTF-8 bytes) share a key, so up to 3 + 1.
        assert 1 <= len(top) <= 4 and top[token] == logprob
        assert all(v <= 0 for v in top.values())
        assert logprob == max(top.values())  # greedy picks the most likely token
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs_give_each_token_its_logprob_and_the_top_3(client):
    out = chat(client, max_tokens=6, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 6
    for entry in content:
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert entry.top_logprobs[0].token == entry.token and values[0] == entry.logprob  # greedy
        assert entry.bytes == list(entry.token.encode("utf-8"))


def test_chat_without_logprobs_returns_none(client):
    assert chat(client, max_tokens=2).choices[0].logprobs is None


def test_same_seed_gives_the_same_sampled_text_across_requests(client):
    def sample(seed):
        return complete(client, temperature=1, seed=seed, max_tokens=24).choices[0].text

    assert sample(42) == sample(42)
    # The seed matters (otherwise the equality above would hold for a sampler that ignores temperature).
    assert len({sample(seed) for seed in (1, 2, 3, 4)}) > 1


def test_echo_returns_the_prompt_before_the_completion(client):
    plain = complete(client, max_tokens=6).choices[0].text
    echoed = complete(client, max_tokens=6, echo=True)
    assert echoed.choices[0].text == PROMPT + plain
    streamed = list(complete(client, max_tokens=6, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == PROMPT + plain


def test_echo_of_a_token_id_prompt_is_the_same_streamed_or_not(client, hf_tokenizer):
    ids = hf_tokenizer.encode(PROMPT)
    plain = complete(client, prompt=ids, max_tokens=6).choices[0].text
    echoed = complete(client, prompt=ids, max_tokens=6, echo=True).choices[0].text
    assert echoed.endswith(PROMPT + plain)
    streamed = "".join(c.choices[0].text for c in complete(client, prompt=ids, max_tokens=6, echo=True, stream=True))
    assert streamed == echoed


def test_prompt_as_token_ids_generates_like_the_same_text(client, hf_tokenizer):
    ids = hf_tokenizer.encode(PROMPT)
    by_text = complete(client, max_tokens=10)
    by_ids = complete(client, prompt=ids, max_tokens=10)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_a_list_of_two_prompts_gets_a_choice_for_each(client, hf_tokenizer):
    prompts = [PROMPT, "The quick brown fox"]
    singles = [complete(client, prompt=p, max_tokens=6).choices[0].text for p in prompts]
    out = complete(client, prompt=prompts, max_tokens=6)
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == singles
    assert out.usage.prompt_tokens == sum(len(hf_tokenizer.encode(p)) for p in prompts)
    assert out.usage.completion_tokens == 12
    chunks = list(complete(client, prompt=prompts, max_tokens=6, stream=True))
    assert ["".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in (0, 1)] == singles


def test_echo_with_logprobs_scores_the_prompt_as_sampling_would_see_each_token(client, hf_tokenizer):
    """What evaluation harnesses send to score a text (echo, logprobs, one token): each prompt token's logprob
    equals its logprob as the one allowed next token of the prefix before it (raw logprobs, a separate path)."""
    text = "Hello world! Hello tokenizers, hello templates."
    ids = hf_tokenizer.encode(text)
    out = complete(client, prompt=text, max_tokens=1, echo=True, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert out.choices[0].text.startswith(text) and lp.text_offset == sorted(lp.text_offset)
    for i in (1, len(ids) // 2, len(ids) - 1):
        forced = complete(client, prompt=ids[:i], max_tokens=1, logprobs=0, extra_body={"allowed_token_ids": [ids[i]]})
        assert forced.choices[0].logprobs.token_logprobs[0] == pytest.approx(lp.token_logprobs[i], abs=1e-4)
    assert all(len(top) >= 2 for top in lp.top_logprobs[1:])
    streamed = list(complete(client, prompt=text, max_tokens=1, echo=True, logprobs=2, stream=True))
    assert sum((c.choices[0].logprobs.token_logprobs for c in streamed), []) == pytest.approx(
        lp.token_logprobs, abs=1e-6
    )


def test_prompt_logprobs_field_returns_vllm_shaped_entries(client, hf_tokenizer):
    ids = hf_tokenizer.encode(PROMPT)
    out = complete(client, max_tokens=2, extra_body={"prompt_logprobs": 1})
    entries = out.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for token_id, entry in zip(ids[1:], entries[1:]):
        assert str(token_id) in entry and {"logprob", "rank", "decoded_token"} <= set(entry[str(token_id)])
    chatted = chat(client, max_tokens=2, extra_body={"prompt_logprobs": 0})
    assert (
        chatted.model_extra["prompt_logprobs"][0] is None
        and len(chatted.model_extra["prompt_logprobs"]) == chatted.usage.prompt_tokens
    )


def test_continue_final_message_continues_the_assistant_reply(client):
    prefilled = MESSAGES + [{"role": "assistant", "content": "Sure: here"}]
    out = chat(
        client,
        messages=prefilled,
        max_tokens=4,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    fresh = chat(client, messages=prefilled, max_tokens=4)
    assert out.usage.prompt_tokens < fresh.usage.prompt_tokens  # no end of turn, no new assistant header
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, messages=prefilled, extra_body={"continue_final_message": True})
    assert e.value.body["param"] == "continue_final_message"


def test_use_beam_search_returns_the_n_best_of_best_of_beams(client):
    out = complete(client, max_tokens=8, n=2, extra_body={"use_beam_search": True, "best_of": 4, "length_penalty": 1.0})
    assert [c.index for c in out.choices] == [0, 1] and out.choices[0].text != out.choices[1].text
    again = complete(client, max_tokens=8, n=2, extra_body={"use_beam_search": True, "best_of": 4})
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # deterministic
    for extra, param in [
        ({"temperature": 0.7}, "temperature"),
        ({"logprobs": 2}, "logprobs"),
        ({"stream": True}, "stream"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(
                model=MODEL_NAME, prompt=PROMPT, max_tokens=4, extra_body={"use_beam_search": True}, **extra
            )
        assert e.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, extra_body={"length_penalty": 2.0})
    assert e.value.body["param"] == "length_penalty"
