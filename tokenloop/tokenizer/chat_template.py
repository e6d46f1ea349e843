"""Render a model's Jinja chat template exactly as Hugging Face transformers renders it."""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


def render_chat_template(
    template: str,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    bos_token: str | None,
    eos_token: str | None,
    continue_final_message: bool = False,
    **kwargs: Any,
) -> str:
    """The prompt text for `messages`; extra kwargs (tools, documents, enable_thinking, ...) reach the template.

    continue_final_message: the prompt ends inside the last message, right after its content (the template's
    end of turn cut off), so the model continues that message (a prefilled assistant reply), as transformers does.
    """
    _check_messages(messages)
    if continue_final_message:
        if add_generation_prompt:
            raise ValueError("continue_final_message: set it or add_generation_prompt, not both")
        final = messages[-1].get("content") or ""
        if not final.strip():
            raise ValueError("continue_final_message: the last message has no content to continue")
    kwargs.setdefault("tools", None)  # transformers always passes these two, so `tools is defined` holds
    kwargs.setdefault("documents", None)
    try:
        text = _compile(template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **kwargs,
        )
    except (jinja2.TemplateError, TypeError, AttributeError, KeyError, IndexError) as e:
        # The template evaluates the caller's messages: what it trips over is in them (a number where it loops).
        raise ValueError(f"messages: the chat template cannot render them: {type(e).__name__}: {e}") from e
    if continue_final_message:
        # Templates may strip the content: look for it stripped, and cut after it.
        end = text.rfind(final.strip())
        if end < 0:
            raise ValueError("continue_final_message: the template does not write the last message's content as it is")
        text = text[: end + len(final.strip())]
    return text


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] must be a dict with a string 'role', got {message!r}")
        content = message.get("content")
        # an assistant turn that only calls tools may carry no content
        if not isinstance(content, str) and not (content is None and message.get("tool_calls")):
            raise ValueError(f"messages[{i}]['content'] must be a string, got {type(content).__name__}")


def _raise_exception(message: str) -> None:
    raise ValueError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
    # jinja's own tojson escapes HTML characters (<, >, &, '), which would change the prompt
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@functools.lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template does not parse: {e} (line {e.lineno})") from e
