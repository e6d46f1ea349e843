"""Anthropic Messages API request bodies (pydantic), and what they are in OpenAI chat's terms: template messages
and a ToolCalling, the shapes tools/calling.py renders.

Strict like protocol.py's: unknown top-level fields are ignored with a warning, known ones that would change the
result (extended thinking, MCP servers, a container, ...) are refused with a 400 naming them, and so are content
blocks and tools this server cannot honour (images, documents, server tools). cache_control is accepted: caching
never changes a token here.
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from tokenloop.sampling.params import SEED_MAX, SEED_MIN
from tokenloop.server.protocol import STRICT, Int, NonEmptyText, find_surrogate
from tokenloop.tools.calling import Function, ToolCalling

logger = logging.getLogger(__name__)

# Top-level fields of Anthropic's API that change the result, with the values that change nothing.
_UNSUPPORTED: dict[str, tuple] = {
    "thinking": (None, {"type": "disabled"}),
    "mcp_servers": (None, []),
    "container": (None,),
    "context_management": (None,),
    "output_format": (None,),
    "output_config": (None, {}),
}
BLOCK_TYPES = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use")}


class _Block(BaseModel):
    model_config = ConfigDict(extra="forbid", **STRICT)
    cache_control: dict[str, Any] | None = None  # prompt caching is automatic here: accepted, changes nothing


class TextBlock(_Block):
    type: Literal["text"]
    text: str
    citations: list[dict[str, Any]] | None = None  # an earlier reply's citations: not read by the model


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)
        return f"Error: {text}" if self.is_error else text  # OpenAI's tool message has no error flag: said in text


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", **STRICT)

    def as_template_messages(self) -> list[dict[str, Any]]:
        """OpenAI chat's messages: an assistant turn's text and tool_use as one message with tool_calls (arguments
        as JSON text); a user turn's tool results as tool messages, its text between them as user messages."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        if self.role == "assistant":
            calls = [
                {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                for b in self.content
                if isinstance(b, ToolUseBlock)
            ]
            text = "".join(b.text for b in self.content if isinstance(b, TextBlock))
            return [{"role": "assistant", "content": text} | ({"tool_calls": calls} if calls else {})]
        out: list[dict[str, Any]] = []
        for b in self.content:
            if isinstance(b, ToolResultBlock):
                out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()})
            elif out and out[-1]["role"] == "user":  # consecutive text blocks make one message
                out[-1]["content"] += b.text
            else:
                out.append({"role": "user", "content": b.text})
        return out or [{"role": "user", "content": ""}]


class UserMessage(_Message):
    role: Literal["user"]
    content: str | list[Annotated[TextBlock | ToolResultBlock, Field(discriminator="type")]]


class AssistantMessage(_Message):
    role: Literal["assistant"]
    content: str | list[Annotated[TextBlock | ToolUseBlock, Field(discriminator="type")]]


Message = Annotated[UserMessage | AssistantMessage, Field(discriminator="role")]


def _an_object_schema(schema: dict[str, Any]) -> dict[str, Any]:
    if schema.get("type") != "object":
        raise ValueError(f"input_schema must have type 'object', got {schema.get('type')!r}")
    return schema


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid", **STRICT)
    type: Literal["custom"] | None = None  # server tools (web search, code execution, ...) are refused
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    input_schema: Annotated[
        dict[str, Any],
        Field(json_schema_extra={"required": ["type"], "properties": {"type": {"const": "object"}}}),
        AfterValidator(_an_object_schema),
    ]
    cache_control: dict[str, Any] | None = None


class _ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", **STRICT)
    disable_parallel_tool_use: bool = False


class ToolChoiceAuto(_ToolChoice):
    type: Literal["auto"]


class ToolChoiceAny(_ToolChoice):
    type: Literal["any"]


class ToolChoiceTool(_ToolChoice):
    type: Literal["tool"]
    name: str


class ToolChoiceNone(BaseModel):
    model_config = ConfigDict(extra="forbid", **STRICT)
    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")]


class Metadata(BaseModel):
    model_config = ConfigDict(extra="ignore", **STRICT)
    user_id: str | None = None


def _unsupported_parts(data: dict) -> str | None:
    """Why a body asks for blocks or tools this server cannot honour, naming the place; None when it does not.
    Reads the raw body (before the types are checked), so it looks only at what has the expected shape."""
    for i, message in enumerate(data.get("messages") or []):
        if not isinstance(message, dict) or not isinstance(role := message.get("role"), str) or role not in BLOCK_TYPES:
            continue
        content, allowed = message.get("content"), BLOCK_TYPES[role]
        for j, block in enumerate(content if isinstance(content, list) else []):
            kind = block.get("type") if isinstance(block, dict) else None
            if isinstance(kind, str) and kind not in allowed:
                return f"messages.{i}.content.{j}.type: {kind} blocks are not supported yet in {role} turns"
            inner = block.get("content") if kind == "tool_result" else None
            for k, part in enumerate(inner if isinstance(inner, list) else []):
                if isinstance(part, dict) and isinstance(part.get("type"), str) and part["type"] != "text":
                    return f"messages.{i}.content.{j}.content.{k}.type: {part['type']} blocks are not supported yet"
    system = data.get("system")
    for j, block in enumerate(system if isinstance(system, list) else []):
        if isinstance(block, dict) and isinstance(block.get("type"), str) and block["type"] != "text":
            return f"system.{j}.type: {block['type']} blocks are not supported yet"
    tools = data.get("tools")
    for j, tool in enumerate(tools if isinstance(tools, list) else []):
        if isinstance(tool, dict) and isinstance(tool.get("type"), str) and tool["type"] != "custom":
            return f"tools.{j}.type: server tools ({tool['type']}) are not supported yet"
    return None


class CountTokensRequest(BaseModel):
    """The conversation and its tools: what POST /v1/messages/count_tokens reads, and /v1/messages besides."""

    model_config = ConfigDict(
        extra="allow",
        json_schema_extra={
            # tool_choice any or tool needs tools
            "if": {
                "required": ["tool_choice"],
                "properties": {"tool_choice": {"properties": {"type": {"enum": ["any", "tool"]}}}},
            },
            "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}},
        },
        **STRICT,
    )

    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: Annotated[list[ToolDefinition], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None  # default: auto with tools

    @model_validator(mode="before")
    @classmethod
    def _supported(cls, data: Any) -> Any:
        if (path := find_surrogate(data, "")) is not None:
            raise ValueError(f"{path.split('.', 1)[0] or 'body'}: {path or 'the body'} is not valid Unicode text")
        if isinstance(data, dict) and (why := _unsupported_parts(data)) is not None:
            raise ValueError(why)
        return data

    @model_validator(mode="after")
    def _no_unsupported_fields(self) -> CountTokensRequest:
        for name, value in (self.model_extra or {}).items():
            if name in _UNSUPPORTED and value not in _UNSUPPORTED[name]:
                raise ValueError(f"{name}: not supported yet")
            if name not in _UNSUPPORTED:
                logger.warning("ignoring the request field %r: this server does not know it", name)
        return self

    def conversation(self) -> tuple[list[dict[str, Any]], bool]:
        """The chat messages, and whether the reply continues the last one: a last assistant turn is a prefill,
        unless blank (the reply is then a new turn, as without it). ValueError naming a last turn's tool_use."""
        system = self.system if isinstance(self.system, str | None) else "".join(b.text for b in self.system)
        head = [{"role": "system", "content": system}] if system else []
        turns = [m for message in self.messages for m in message.as_template_messages()]
        if self.messages[-1].role != "assistant":
            return head + turns, False
        if turns[-1].get("tool_calls"):
            raise ValueError(
                f"messages.{len(self.messages) - 1}: tool_use needs a user turn after it with its tool_result"
            )
        if not turns[-1]["content"].strip():
            return head + turns[:-1], False
        return head + turns, True

    def tool_calling(self) -> ToolCalling | None:
        """The tools and how they may be called (any: required; tool: the named one); ValueError naming the field."""
        choice = self.tool_choice
        kind = {"auto": "auto", "any": "required", "none": "none", None: None}.get(getattr(choice, "type", None))
        kind = choice.name if isinstance(choice, ToolChoiceTool) else kind
        if not self.tools and kind in (None, "none", "auto"):  # nothing to call
            return None
        if not self.tools:
            raise ValueError(f"tool_choice: type {choice.type} needs tools")
        functions = [Function(t.name, t.description, t.input_schema) for t in self.tools]
        parallel = not getattr(choice, "disable_parallel_tool_use", False)
        try:
            return ToolCalling(functions, kind or "auto", parallel)
        except ValueError as e:
            raise ValueError(f"tool_choice.name: {e}" if isinstance(choice, ToolChoiceTool) else str(e)) from None


class MessagesRequest(CountTokensRequest):
    max_tokens: Int(ge=1)
    stop_sequences: list[NonEmptyText] | None = None
    temperature: Annotated[float, Field(ge=0, le=1)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Int(ge=0) | None = None
    seed: Int(ge=SEED_MIN, le=SEED_MAX) | None = None  # extension (vLLM)
    stream: bool = False
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here: changes nothing
    cache_control: dict[str, Any] | None = None  # prompt caching is automatic here: accepted, changes nothing
