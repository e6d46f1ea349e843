"""Chat templates render as transformers renders them, and bad templates or messages fail clearly."""

from __future__ import annotations

import pytest

from tokenloop.tokenizer.chat_template import _compile, render_chat_template
from tokenloop.tokenizer.tokenizer import Tokenizer

CONVERSATIONS = {
    "system_and_user": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    "user_only": [{"role": "user", "content": "Tell me a joke about 中文 and 😀."}],
    "multi_turn": [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Count to three.\n\nThen stop."},
    ],
}


def hf_ids(out) -> list[int]:
    # transformers 5 returns a BatchEncoding from tokenize=True; older versions a plain list
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.real_model
@pytest.mark.parametrize("name", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_smollm_template_matches_transformers(smollm: Tokenizer, hf_smollm, name: str, add_generation_prompt: bool):
    messages = CONVERSATIONS[name]
    text = smollm.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    hf_text = hf_smollm.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert text == hf_text
    ids = smollm.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    hf_out = hf_smollm.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    assert ids == hf_ids(hf_out)
    assert ids[0] == smollm.bos_token_id  # "<|im_start|>" in the text became its id, not pieces


def render(template: str, messages=None, **kwargs) -> str:
    messages = [{"role": "user", "content": "hi"}] if messages is None else messages
    return render_chat_template(template, messages, False, "<s>", "</s>", **kwargs)


def test_raise_exception_becomes_value_error_with_the_templates_message():
    template = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('System message required!') }}{% endif %}"
    with pytest.raises(ValueError, match="System message required!"):
        render(template)


def test_tojson_keeps_non_ascii_and_html_characters_and_indents():
    assert render("{{ {'a': '<中>'} | tojson }}") == '{"a": "<中>"}'
    assert render("{{ [1] | tojson(indent=2) }}") == "[\n  1\n]"


def test_blocks_are_trimmed_and_loop_controls_work():
    template = (
        "{% for m in messages %}\n  {% if loop.index > 1 %}{% break %}{% endif %}\n{{ m['content'] }}\n{% endfor %}"
    )
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert render(template, messages) == "a\n"


def test_globals_and_extra_kwargs_reach_the_template():
    template = "{{ bos_token }}{{ tools is none }}{{ enable_thinking }}{{ strftime_now('%Y')|length }}{{ eos_token }}"
    assert render(template, enable_thinking=False) == "<s>TrueFalse4</s>"


def test_each_template_compiles_once():
    template = "{{ messages | length }}"
    assert render(template) == "1"
    assert _compile(template) is _compile(template)


@pytest.mark.parametrize(
    "messages",
    [
        "hi",
        [["user", "hi"]],
        [{"content": "no role"}],
        [{"role": "user"}],
        [{"role": "user", "content": 3}],
        [{"role": None, "content": "hi"}],
    ],
)
def test_malformed_messages_raise_value_error(messages):
    with pytest.raises(ValueError, match="messages"):
        render("{{ messages }}", messages)


def test_tool_call_turn_may_have_no_content():
    messages = [{"role": "assistant", "content": None, "tool_calls": [{"name": "f"}]}]
    assert render("{{ messages[0]['tool_calls'][0]['name'] }}", messages) == "f"


def test_template_syntax_error_is_value_error():
    with pytest.raises(ValueError, match="does not parse"):
        render("{% for m in messages %}")


@pytest.mark.real_model
def test_continue_final_message_matches_transformers(smollm: Tokenizer, hf_smollm):
    messages = CONVERSATIONS["system_and_user"] + [{"role": "assistant", "content": "The answer is"}]
    text = smollm.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert text == hf_smollm.apply_chat_template(
        messages, add_generation_prompt=False, continue_final_message=True, tokenize=False
    )
    assert text.endswith("The answer is")
    with pytest.raises(ValueError, match="continue_final_message"):
        smollm.apply_chat_template(messages, add_generation_prompt=True, continue_final_message=True)
