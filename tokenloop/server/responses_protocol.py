"""The Responses API's request body (pydantic) and its translation into what chat already takes: template messages
(OpenAI chat's shape: assistant `tool_calls`, `tool` messages), a ToolCalling and SamplingParams."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from tokenloop.sampling.params import SEED_MAX, SEED_MIN, SamplingParams
from tokenloop.sampling.structured import StructuredOutputsParams
from tokenloop.server.protocol import STRICT, FunctionDefinition, Int, _Request
from tokenloop.tools.calling import Function, ToolCalling

# Fields of the Responses API that change the result and that this server does not honour: refused unless neutral.
# (include: entries that add content; reasoning.encrypted_content adds none here, as no reasoning item is made.)
_UNSUPPORTED: dict[str, tuple] = {
    "background": (None, False),
    "conversation": (None,),
    "prompt": (None,),
    "max_tool_calls": (None,),
    "reasoning": (None, {}, {"effort": None}, {"effort": None, "summary": None}),
    "include": (None, [], ["reasoning.encrypted_content"]),
    "truncation": (None, "disabled"),
    "top_logprobs": (None, 0),
    "context_management": (None,),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None,),  # chat's name: Responses says text.format
}


class _Item(BaseModel):
    # Items echoed back from an earlier response carry id, status, annotations, logprobs: ignored.
    model_config = ConfigDict(extra="ignore", **STRICT)


class TextContent(_Item):
    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextContent]


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1)]
    name: str
    arguments: str  # JSON text of the arguments object


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1)]
    output: str | list[TextContent]


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem


class PlainText(BaseModel):
    model_config = ConfigDict(extra="forbid", **STRICT)
    type: Literal["text"]


class JsonObject(BaseModel):
    model_config = ConfigDict(extra="forbid", **STRICT)
    type: Literal["json_object"]


class JsonSchema(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True, **STRICT)
    type: Literal["json_schema"]
    name: str = "response"
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None
    description: str | None = None


# text.format: free text, any JSON object, or JSON following a schema
TextFormat = Annotated[PlainText | JsonObject | JsonSchema, Field(discriminator="type")]


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore", **STRICT)
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # low or high would change the reply; a small model has no knob


class FunctionTool(FunctionDefinition):
    """The Responses API's flat function tool (chat nests name and parameters under `function`)."""

    type: Literal["function"]


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", **STRICT)
    type: Literal["function"]
    name: str


class ResponsesRequest(_Request):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [{"input": "Hi", "max_output_tokens": 16, "temperature": 0}],
            # tool_choice "required" or a named function needs tools
            "if": {
                "required": ["tool_choice"],
                "properties": {"tool_choice": {"anyOf": [{"const": "required"}, {"type": "object"}]}},
            },
            "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}},
        }
    )
    unsupported: ClassVar[dict[str, tuple]] = _UNSUPPORTED

    model: str | None = None
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None  # a system message first; not carried over by previous_response_id
    max_output_tokens: Int(ge=1) | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Int(ge=-1) | None = None  # extension (vLLM)
    seed: Int(ge=SEED_MIN, le=SEED_MAX) | None = None  # extension (vLLM)
    text: TextConfig | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None  # default: auto with tools
    parallel_tool_calls: bool | None = None
    stream: bool | None = None
    store: bool | None = None  # default true
    previous_response_id: str | None = None
    metadata: Annotated[dict[str, Annotated[str, Field(max_length=512)]], Field(max_length=16)] | None = None
    user: str | None = None

    def items(self) -> list[dict[str, Any]]:
        """The input as a list of items (plain dicts): a string is one user message."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return [item.model_dump() for item in self.input]

    def tool_calling(self) -> ToolCalling | None:
        """The tools and how they may be called; ValueError naming tools or tool_choice."""
        choice = self.tool_choice.name if isinstance(self.tool_choice, NamedFunction) else self.tool_choice
        if not self.tools and choice in (None, "none"):
            return None
        functions = [Function(t.name, t.description, t.parameters or {"type": "object"}) for t in self.tools or []]
        calling = ToolCalling(functions, choice or "auto", self.parallel_tool_calls is not False)
        if calling.constrained and self.structured() is not None:
            raise ValueError(
                "tool_choice: tools constrain the reply already; set tool_choice to none to use text.format"
            )
        return calling

    def structured(self) -> StructuredOutputsParams | None:
        fmt = self.text.format if self.text is not None else None
        if isinstance(fmt, JsonSchema):
            return StructuredOutputsParams(json=fmt.schema_)
        return StructuredOutputsParams(json_object=True) if isinstance(fmt, JsonObject) else None

    def sampling_params(self, tools: ToolCalling | None) -> SamplingParams:
        """Raises ValueError naming the field (SamplingParams' name) for values out of range."""
        constrained = tools is not None and tools.constrained
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            seed=self.seed,
            max_tokens=self.max_output_tokens,
            structured_outputs=tools.structured_outputs() if constrained else self.structured(),
        )


def template_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses items (input, or an earlier response's output) as chat template messages: a function_call joins
    the assistant message just before it (the model wrote them as one turn), a function_call_output is a `tool`
    message naming its call's function."""
    messages: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item["role"], "content": _text(item["content"])})
        elif kind == "function_call":
            names[item["call_id"]] = item["name"]
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": ""})
            messages[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            message = {"role": "tool", "tool_call_id": item["call_id"], "content": _text(item["output"])}
            if item["call_id"] in names:
                message["name"] = names[item["call_id"]]
            messages.append(message)
    return messages


def _text(content: str | list[dict[str, Any]]) -> str:
    """Text parts are joined: the models served here read text only."""
    return content if isinstance(content, str) else "".join(part["text"] for part in content)
