"""OpenAI API request bodies (pydantic) and how their fields become SamplingParams.

Admission does every per-request check here, so that the engine only ever sees requests it can run: types
are strict (true is not 1, [[false]] is not a token), numbers finite and in their documented ranges, seeds
signed 64-bit, text valid Unicode (no lone surrogates). The ranges are part of the OpenAPI schema.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from tokenloop.engine.beam_search import BeamSearchParams
from tokenloop.sampling.params import MAX_LOGPROBS, SEED_MAX, SEED_MIN, SamplingParams
from tokenloop.sampling.structured import StructuredOutputsParams
from tokenloop.strategies.self_consistency import AnswerSpec
from tokenloop.tools.calling import Function, ToolCalling

logger = logging.getLogger(__name__)

# Strict: no coercion of booleans into numbers or numbers into strings; no NaN or infinity.
STRICT = ConfigDict(strict=True, allow_inf_nan=False)
# JSON Schema counts 5.0 as an integer; strict pydantic does not. A whole float is taken as the integer it is.
_WHOLE = BeforeValidator(lambda v: int(v) if isinstance(v, float) and v.is_integer() else v)


def Int(**bounds) -> Any:
    """An integer field (bounds as Field's ge, le, ...) that also takes a whole float."""
    return Annotated[int, Field(**bounds), _WHOLE]


TokenId = Int(ge=0)
# Token ids written as strings (OpenAI's) -> a bias in [-100, 100]. Pydantic writes the key pattern as
# patternProperties, which alone would let other keys through the schema.
LogitBias = Annotated[
    dict[Annotated[str, Field(pattern=r"^[0-9]+$")], Annotated[float, Field(ge=-100, le=100)]],
    Field(max_length=300, json_schema_extra={"additionalProperties": False}),
]
NonEmptyText = Annotated[str, Field(min_length=1)]

# Fields of OpenAI's API (and vLLM's) that change the result and that this server cannot honour (tools: on
# completions): a request that sets one to anything but its neutral value is refused, never served as if it had
# not asked.
_UNSUPPORTED: dict[str, tuple] = {
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "use_beam_search": (None, False),  # on chat; completions take it
    "audio": (None,),
    "modalities": (None, ["text"]),
    "web_search_options": (None,),
}


def _structured(field: str, **spec) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**spec)
    except ValueError as e:
        raise ValueError(str(e) if str(e).startswith(field) else f"{field}: {e}") from None


def find_surrogate(value: Any, path: str) -> str | None:
    """The path of the first string in a JSON value that holds a lone surrogate (not encodable text), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and find_surrogate(key, path) is not None:
            return path
        if (found := find_surrogate(item, f"{path}.{key}" if path else str(key))) is not None:
            return found
    return None


class _Request(BaseModel):
    # Unknown fields are ignored, as vLLM does (clients send vendor extensions freely), except the known ones
    # in `unsupported` (each API its own table), which would change the result.
    model_config = ConfigDict(extra="allow", **STRICT)
    unsupported: ClassVar[dict[str, tuple]] = _UNSUPPORTED

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        if (path := find_surrogate(data, "")) is not None:
            raise ValueError(
                f"{path.split('.', 1)[0] or 'body'}: {path or 'the body'} is not valid Unicode text "
                "(it holds a lone surrogate)"
            )
        return data

    @model_validator(mode="after")
    def _no_unsupported_fields(self) -> _Request:
        for name, value in (self.model_extra or {}).items():
            if name in self.unsupported and not any(
                value == neutral and type(value) is type(neutral) for neutral in self.unsupported[name]
            ):
                raise ValueError(f"{name}: not supported yet")
            if name not in self.unsupported:
                logger.warning("ignoring the request field %r: this server does not know it", name)
        return self


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True, **STRICT)
    name: str | None = None
    schema_: dict[str, Any] | bool = Field(alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (no constraint), any JSON object, or JSON following a schema."""

    model_config = ConfigDict(extra="forbid", **STRICT)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(BaseModel):
    """vLLM's extra body field structured_outputs: exactly one of its fields (the schema says so)."""

    model_config = ConfigDict(
        extra="forbid", populate_by_name=True, json_schema_extra={"minProperties": 1, "maxProperties": 1}, **STRICT
    )
    # Not nullable: a field present is the one set (defaults of None only mark the absent ones).
    json_: dict[str, Any] = Field(None, alias="json")
    json_object: Literal[True] = None
    regex: str = None
    grammar: str = None
    choice: Annotated[list[NonEmptyText], Field(min_length=1)] = None


class SelfConsistencyBody(BaseModel):
    """tokenloop's extension: n samples vote; the reply is the winning sample, with the votes."""

    model_config = ConfigDict(extra="forbid", **STRICT)
    answer: NonEmptyText | dict[str, Any]  # a regex with one group, or a JSON schema with an "answer" property


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", **STRICT)
    include_usage: bool = False


class _SamplingRequest(_Request):
    model: str | None = None
    max_tokens: Int(ge=1) | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Int(ge=-1) = -1  # extension (vLLM); -1 or 0 = off
    min_p: Annotated[float, Field(ge=0, le=1)] = 0.0  # extension (vLLM)
    n: Int(ge=1) = 1  # at most the server's --max-n (written into the served schema)
    stop: NonEmptyText | Annotated[list[NonEmptyText], Field(max_length=16)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=64)] | None = None  # extension (vLLM)
    ignore_eos: bool = False  # extension (vLLM)
    seed: Int(ge=SEED_MIN, le=SEED_MAX) | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Logits processors (sampling/processors.py); logit_bias's keys are token ids written as strings (OpenAI's).
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    logit_bias: LogitBias | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=10)] = 1.0  # extension (vLLM)
    min_tokens: Int(ge=0) = 0  # extension (vLLM)
    bad_words: Annotated[list[Annotated[str, Field(pattern=r"\S")]], Field(max_length=64)] | None = (
        None  # extension (vLLM)
    )
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None  # extension (vLLM)
    no_repeat_ngram_size: Int(ge=0) = 0  # extension (transformers)
    prompt_logprobs: Int(ge=0, le=MAX_LOGPROBS) | None = (
        None  # extension (vLLM): logprobs of the prompt's tokens, top k
    )
    self_consistency: SelfConsistencyBody | None = None  # extension (tokenloop): the n samples vote on their answer
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None  # extension (vLLM)
    user: str | None = None

    def answer_spec(self) -> AnswerSpec | None:
        """How self_consistency reads each sample's answer; ValueError naming the field."""
        if self.self_consistency is None:
            return None
        if self.stream:
            raise ValueError("stream: not supported with self_consistency (the winner is known at the end)")
        if getattr(self, "best_of", None) is not None or getattr(self, "use_beam_search", False):
            raise ValueError("self_consistency: not with best_of or use_beam_search")
        try:
            spec = AnswerSpec.of(self.self_consistency.answer)
        except ValueError as e:
            raise ValueError(f"self_consistency.{e}") from None
        if spec.schema is not None and self.structured() is not None:
            raise ValueError(
                "self_consistency: an answer schema constrains the samples already; "
                "drop response_format / structured_outputs"
            )
        return spec

    def structured(self) -> StructuredOutputsParams | None:
        """The one grammar response_format or structured_outputs asks for; ValueError naming the field."""
        fmt = self.response_format
        if fmt is not None and fmt.type != "text" and self.structured_outputs is not None:
            raise ValueError("response_format: set it or structured_outputs, not both")
        if fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise ValueError("response_format: type json_schema needs json_schema.schema")
            return _structured("response_format", json=fmt.json_schema.schema_)
        if fmt is not None and fmt.type == "json_object":
            return _structured("response_format", json_object=True)
        if (body := self.structured_outputs) is not None:
            return _structured(
                "structured_outputs",
                json=body.json_,
                json_object=bool(body.json_object),
                regex=body.regex,
                grammar=body.grammar,
                choice=body.choice,
            )
        return None

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, n: int | None = None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        """Raises ValueError naming the field for values out of range."""
        return SamplingParams(
            prompt_logprobs=self.prompt_logprobs
            if prompt_logprobs is None
            else max(prompt_logprobs, self.prompt_logprobs or 0),
            n=n or self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            max_tokens=max_tokens,
            stop=self.stop or [],
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()} or None,
            repetition_penalty=self.repetition_penalty,
            min_tokens=self.min_tokens,
            bad_words=self.bad_words or [],
            allowed_token_ids=self.allowed_token_ids,
            no_repeat_ngram_size=self.no_repeat_ngram_size,
            structured_outputs=self.structured(),
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [{"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}],
            # length_penalty and early_stopping other than their defaults only with use_beam_search
            "if": {"not": {"required": ["use_beam_search"], "properties": {"use_beam_search": {"const": True}}}},
            "then": {"properties": {"length_penalty": {"const": 1.0}, "early_stopping": {"const": False}}},
        }
    )

    prompt: (
        NonEmptyText
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[NonEmptyText | Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    )
    max_tokens: Int(ge=1) | None = 16  # OpenAI's default for completions
    logprobs: Int(ge=0, le=MAX_LOGPROBS) | None = None
    echo: bool = False
    best_of: Int(ge=1) | None = None  # completions to run, of which the n most likely are returned
    use_beam_search: bool = False  # extension (vLLM): best_of (or n) beams, the n best returned
    length_penalty: Annotated[float, Field(ge=-10, le=10)] = 1.0  # extension (vLLM), beam search only
    early_stopping: bool | Literal["never"] = False  # extension (vLLM), beam search only

    # What a beam search takes besides its own fields; anything else set would be ignored by it, so it is refused.
    _BEAM_FIELDS: ClassVar[frozenset[str]] = frozenset(
        {
            "model",
            "prompt",
            "max_tokens",
            "n",
            "best_of",
            "use_beam_search",
            "length_penalty",
            "early_stopping",
            "ignore_eos",
            "echo",
            "user",
            "seed",
            "stream_options",
        }
    )

    def beam_search_params(self) -> BeamSearchParams | None:
        if not self.use_beam_search:
            for name in ("length_penalty", "early_stopping"):  # their defaults change nothing: accepted
                if getattr(self, name) != type(self).model_fields[name].default:
                    raise ValueError(f"{name}: only with use_beam_search")
            return None
        for name in sorted(self.model_fields_set - self._BEAM_FIELDS):
            if name == "temperature" and self.temperature == 0 or name == "stream" and not self.stream:
                continue
            raise ValueError(f"{name}: not supported with use_beam_search")
        return BeamSearchParams(
            beam_width=self.best_of or self.n,
            max_tokens=self.max_tokens,
            n=self.n,
            length_penalty=self.length_penalty,
            early_stopping=self.early_stopping,
            ignore_eos=self.ignore_eos,
        )

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        return [p] if isinstance(p, str) or isinstance(p[0], int) else list(p)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", **STRICT)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # Other fields (name, tool_calls, tool_call_id, ...) reach the chat template, as transformers passes them.
    model_config = ConfigDict(extra="allow", **STRICT)

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None

    def as_template_message(self) -> dict[str, Any]:
        """Text parts are joined: the models served here read text only."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {**(self.model_extra or {}), "role": self.role, "content": content if content is not None else ""}


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore", **STRICT)
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments; none = any object
    strict: bool | None = None  # arguments always follow the schema here (its grammar enforces it)


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", **STRICT)
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid", **STRICT)
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", **STRICT)
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_SamplingRequest):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16, "temperature": 0}],
            # top_logprobs only with logprobs: true
            "not": {
                "required": ["top_logprobs"],
                "properties": {"top_logprobs": {"type": "integer"}, "logprobs": {"const": False}},
            },
            # tool_choice "required" or a named function needs tools
            "if": {
                "required": ["tool_choice"],
                "properties": {"tool_choice": {"anyOf": [{"const": "required"}, {"type": "object"}]}},
            },
            "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}},
        }
    )

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Int(ge=1) | None = None
    logprobs: bool = False
    top_logprobs: Int(ge=0, le=MAX_LOGPROBS) | None = None
    add_generation_prompt: bool = True  # extension (vLLM)
    continue_final_message: bool = (
        False  # extension (vLLM): continue the last message (with add_generation_prompt false)
    )
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = (
        None  # default: auto with tools, else none
    )
    parallel_tool_calls: bool = True

    def tool_calling(self) -> ToolCalling | None:
        """The tools and how they may be called; ValueError naming tools or tool_choice."""
        choice = self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else self.tool_choice
        if not self.tools and choice in (None, "none"):
            return None
        functions = [Function.from_openai(t.function.model_dump()) for t in self.tools or []]
        calling = ToolCalling(functions, choice or "auto", self.parallel_tool_calls)
        if calling.constrained and (
            self.structured_outputs is not None
            or (self.response_format is not None and self.response_format.type != "text")
        ):
            raise ValueError(
                "tool_choice: tools constrain the reply already; "
                "set tool_choice to none to use response_format or structured_outputs"
            )
        return calling

    def structured(self) -> StructuredOutputsParams | None:
        calling = self.tool_calling()
        return calling.structured_outputs() if calling is not None and calling.constrained else super().structured()

    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def effective_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return (self.top_logprobs or 0) if self.logprobs else None
