"""Tool calling: how a chat's tools reach the model, and the grammar that makes its calls valid.

A call is written as Hermes / Qwen write it:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Tools reach the model through its own chat template when the template takes `tools`; otherwise a system
message lists them as JSON and shows that format (`render_tools`), and earlier calls and tool results in the
conversation are written in the same format. tool_choice "required" or a named function is a grammar of calls
only (a named function: one call), each call's arguments the function's parameters schema (llguidance's %json),
so arguments always parse and validate; "auto" lets text come first, and once the text writes the call's opening
the call must follow the grammar (a lazy trigger); "none" leaves the output free.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tokenloop.sampling.structured import JSON_OPTIONS, GrammarCompiler, StructuredOutputsParams

CALL_OPEN, CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"
TOOL_CHOICES = ("none", "auto", "required")


@dataclass(slots=True)
class Function:
    name: str
    description: str | None
    parameters: dict[str, Any]  # a JSON schema of the arguments object

    @classmethod
    def from_openai(cls, function: dict[str, Any]) -> Function:
        """From the `function` of an OpenAI tool: name, description, parameters (none = any object)."""
        return cls(function["name"], function.get("description"), function.get("parameters") or {"type": "object"})

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "parameters": self.parameters}


def call_prefix(name: str) -> str:
    """The fixed text of a call up to its arguments (the grammar writes the wrapper exactly this way)."""
    return CALL_OPEN + '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '


CALL_SUFFIX = "}" + CALL_CLOSE


@dataclass(slots=True)
class ToolCalling:
    """A chat request's tools and its tool_choice: "none", "auto", "required", or the one function to call."""

    functions: list[Function]
    choice: str = "auto"
    parallel: bool = True  # several calls in one turn

    def __post_init__(self) -> None:
        names = [f.name for f in self.functions]
        if len(set(names)) != len(names):
            raise ValueError(f"tools: function names must be unique, got {names}")
        if self.choice not in TOOL_CHOICES and self.choice not in names:
            raise ValueError(
                f"tool_choice names the function {self.choice!r}, "
                f"which is not among the tools ({', '.join(names) or 'none given'})"
            )
        if self.choice == "required" and not self.functions:
            raise ValueError("tool_choice 'required' needs tools")

    def check(self, grammars: GrammarCompiler) -> None:
        """Compile each parameters schema alone (cached), so that one llguidance cannot honour is a ValueError
        naming its tool, before the whole grammar is built."""
        for i, function in enumerate(self.functions):
            try:
                grammars.grammar(StructuredOutputsParams(json=function.parameters))
            except ValueError as e:
                raise ValueError(
                    f"tools[{i}].function.parameters: {str(e).removeprefix('structured_outputs.json: ')}"
                ) from None

    @property
    def constrained(self) -> bool:
        return self.choice != "none" and bool(self.functions)

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The grammar of this turn's output (None when tool_choice is none): a Lark grammar in llguidance's dialect."""
        if not self.constrained:
            return None
        called = [f for f in self.functions if self.choice in ("auto", "required") or f.name == self.choice]
        rules = ["%llguidance {}"]
        # A named function is called once (as vLLM does); required and auto may make several calls when parallel.
        more = ' ("\\n" call)*' if self.parallel and self.choice in ("auto", "required") else ""
        if self.choice == "auto":
            # Free text, or text up to the call's opening (lazy: it ends there) and then calls only.
            rules += [
                f"start: TEXT | opening call_body{more}",
                '''opening[lazy]: TEXT "<tool_call>"''',
                "TEXT: /(.|\\n)*/",
            ]
        else:
            rules += [f"start: call{more}"]
        rules += ['call: "<tool_call>" call_body', "call_body: " + " | ".join(f"tool_{i}" for i in range(len(called)))]
        for i, function in enumerate(called):
            # The wrapper is fixed text and the arguments their own JSON document, so a schema's $refs keep their root.
            schema = function.parameters | {"x-guidance": JSON_OPTIONS}
            head = call_prefix(function.name).removeprefix("<tool_call>")
            rules.append(f"tool_{i}: {json.dumps(head)} %json {json.dumps(schema)} {json.dumps(CALL_SUFFIX)}")
        return StructuredOutputsParams(grammar="\n".join(rules) + "\n")

    def render(
        self, messages: list[dict[str, Any]], template_takes_tools: bool
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The conversation and the template's extra arguments: tools for a template that takes them, else the
        default rendering (a system message that lists them; calls and results written in the call format)."""
        messages = [_arguments_as_objects(m) for m in messages]
        if template_takes_tools:
            return messages, {"tools": [{"type": "function", "function": f.as_dict()} for f in self.functions] or None}
        return render_tools(messages, self.functions), {}


def _arguments_as_objects(message: dict[str, Any]) -> dict[str, Any]:
    """Templates read a call's arguments as an object; OpenAI's clients send them as JSON text."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        function = dict(call.get("function") or {})
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except json.JSONDecodeError:
                raise ValueError(
                    f"messages: a tool call's arguments are not JSON: {function['arguments'][:80]!r}"
                ) from None
        calls.append({**call, "function": function})
    return {**message, "tool_calls": calls}


def format_call(name: str, arguments: Any) -> str:
    return call_prefix(name) + json.dumps(arguments, ensure_ascii=False) + CALL_SUFFIX


def render_tools(messages: list[dict[str, Any]], functions: list[Function]) -> list[dict[str, Any]]:
    """The default rendering, for templates that know nothing of tools (documented in the README)."""
    out = []
    for message in messages:
        if message.get("tool_calls"):
            calls = "\n".join(
                format_call(c["function"]["name"], c["function"].get("arguments", {})) for c in message["tool_calls"]
            )
            message = {"role": message["role"], "content": ((message.get("content") or "") + "\n" + calls).lstrip("\n")}
        elif message.get("role") == "tool":
            message = {"role": "user", "content": f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"}
        out.append(message)
    if not functions:
        return out
    listing = "\n".join(json.dumps(f.as_dict(), ensure_ascii=False) for f in functions)
    instructions = (
        "You can call these functions. To call one, answer with exactly\n"
        + format_call("<function name>", "<arguments object>").replace('"<arguments object>"', "<arguments object>")
        + f"\nFunctions:\n{listing}"
    )
    if out and out[0]["role"] == "system":
        return [{**out[0], "content": f"{out[0]['content']}\n\n{instructions}"}] + out[1:]
    return [{"role": "system", "content": instructions}] + out
