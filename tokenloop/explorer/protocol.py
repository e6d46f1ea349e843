"""The explore API's bodies, every field bounded (the schemathesis run cannot make the server hold more than the
store's caps); pydantic models, so the OpenAPI schema documents them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tokenloop.sampling.params import SamplingParams
from tokenloop.sampling.structured import StructuredOutputsParams
from tokenloop.server.protocol import STRICT, Int, LogitBias, TokenId

MAX_EXPLORE_TOKENS = 256
MAX_TOP_N = 64
MAX_SEED = 2**31 - 1


class ExploreParams(BaseModel):
    """The sampling settings of a tree (and of a step's live controls): SamplingParams' fields that shape the
    distribution."""

    model_config = ConfigDict(extra="forbid", **STRICT)

    temperature: float = Field(1.0, ge=0, le=100)
    top_k: Int(ge=-1, le=2**20) = -1
    top_p: float = Field(1.0, gt=0, le=1)
    min_p: float = Field(0.0, ge=0, le=1)
    seed: Int(ge=0, le=MAX_SEED) | None = None
    repetition_penalty: float = Field(1.0, gt=0, le=10)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    no_repeat_ngram_size: Int(ge=0, le=16) = 0
    min_tokens: Int(ge=0, le=MAX_EXPLORE_TOKENS) = 0
    logit_bias: LogitBias | None = None
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1, max_length=4096)
    bad_words: list[str] = Field(default_factory=list, max_length=32)
    json_schema: dict[str, Any] | None = None
    regex: str | None = Field(None, min_length=1, max_length=1000)

    def sampling_params(self, seed: int, max_tokens: int) -> SamplingParams:
        """ValueError (a 400) naming the field at fault."""
        if self.json_schema is not None and self.regex is not None:
            raise ValueError("json_schema and regex: give at most one")
        structured = None
        if self.json_schema is not None or self.regex is not None:
            structured = StructuredOutputsParams(json=self.json_schema, regex=self.regex)
        bias = {int(token): value for token, value in self.logit_bias.items()} if self.logit_bias else None
        fields = self.model_dump(exclude={"seed", "logit_bias", "json_schema", "regex"})
        return SamplingParams(
            **fields,
            seed=seed,
            max_tokens=max_tokens,
            logit_bias=bias,
            structured_outputs=structured,
            trace=True,
        )


class NewTree(BaseModel):
    model_config = ConfigDict(extra="forbid", **STRICT)

    # Text (tokenized as /v1/completions does, special tokens included) or token ids.
    prompt: (
        Annotated[str, Field(min_length=1, max_length=20_000)]
        | Annotated[list[TokenId], Field(min_length=1, max_length=8192)]
    )
    chat: bool = False  # the prompt as one user message through the chat template
    params: ExploreParams = Field(default_factory=ExploreParams)
    max_tokens: Int(ge=1, le=MAX_EXPLORE_TOKENS) = 16
    top_n: Int(ge=1, le=MAX_TOP_N) = 10


class Reshape(BaseModel):
    model_config = ConfigDict(extra="forbid", **STRICT)

    params: ExploreParams


class BranchFrom(BaseModel):
    model_config = ConfigDict(extra="forbid", **STRICT)

    token_id: Int(ge=0)
    max_tokens: Int(ge=1, le=MAX_EXPLORE_TOKENS) = 16  # sampled after the picked token


class Continue(BaseModel):
    model_config = ConfigDict(extra="forbid", **STRICT)

    max_tokens: Int(ge=1, le=MAX_EXPLORE_TOKENS) = 1


class SampleVote(BaseModel):
    model_config = ConfigDict(extra="forbid", **STRICT)

    n: Int(ge=2, le=16) = 5
    max_tokens: Int(ge=1, le=MAX_EXPLORE_TOKENS) = 32
    answer: str = Field(r"(\d+)", min_length=1, max_length=1000)  # a regex with one group: a sample's answer


class Beam(BaseModel):
    model_config = ConfigDict(extra="forbid", **STRICT)

    beam_width: Int(ge=1, le=8) = 3
    max_tokens: Int(ge=1, le=64) = 16


class TreeOut(BaseModel):
    """A tree (see docs/explorer.md for every field): its id and branches name what the other routes take."""

    model_config = ConfigDict(extra="allow")

    id: str
    seed: int
    block_size: int
    branches: list[dict[str, Any]]


class Freed(BaseModel):
    model_config = ConfigDict(**STRICT)

    freed_blocks: int
    num_free_blocks: int


class ExportedBranch(BaseModel):
    model_config = ConfigDict(extra="allow", **STRICT)  # an export carries each token's figures too; replay needs these

    id: str = Field(max_length=16)
    parent: str | None = Field(None, max_length=16)
    start: Int(ge=1)
    kind: Literal["sample", "branch", "vote", "beam"]
    token_ids: list[TokenId] = Field(max_length=MAX_EXPLORE_TOKENS * 64)
    answer: str | None = None


class ExportedTree(BaseModel):
    model_config = ConfigDict(extra="allow", **STRICT)

    prompt_token_ids: list[TokenId] = Field(min_length=1, max_length=8192)
    params: ExploreParams
    seed: Int(ge=0, le=MAX_SEED)
    max_tokens: Int(ge=1, le=MAX_EXPLORE_TOKENS)
    top_n: Int(ge=1, le=MAX_TOP_N)
    branches: list[ExportedBranch] = Field(min_length=1, max_length=64)


class SegmentRun(BaseModel):
    model_config = ConfigDict(extra="forbid", **STRICT)

    seed: Int(ge=0, le=2 * MAX_SEED)
    max_tokens: Int(ge=1, le=MAX_EXPLORE_TOKENS)


class Replay(BaseModel):
    model_config = ConfigDict(extra="forbid", **STRICT)

    segments: dict[str, list[SegmentRun]] = Field(max_length=64)
    beam: Beam | None = None
    vote: dict[str, Any] | None = None


class Exported(BaseModel):
    """A tree as `export` writes it: its data and the segments that replay it."""

    model_config = ConfigDict(extra="forbid", **STRICT)

    format: Literal["tokenloop-explore"]
    version: Literal[1]
    tree: ExportedTree
    replay: Replay
