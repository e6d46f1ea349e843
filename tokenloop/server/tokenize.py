"""vLLM's tokenizer routes: POST /tokenize, POST /detokenize, GET /tokenizer_info.

lm-evaluation-harness's `local-completions` looks for them and, finding them, tokenizes through the server instead
of loading a tokenizer by the model's name (which fails offline). A translation onto the engine's InputProcessor,
run on its input threads like every other prompt; nothing is bounded by the context here (a long document is
tokenized to be cut into windows), and `count` and `max_model_len` say whether it fits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

from fastapi import FastAPI
from pydantic import ConfigDict, Field

from tokenloop.engine.client import EngineClient
from tokenloop.server.errors import ERROR_RESPONSES, APIError, param_of
from tokenloop.server.protocol import ChatMessage, Int, _Request


class TokenizeCompletionRequest(_Request):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Request):
    model_config = ConfigDict(
        json_schema_extra={  # continuing the last message means no generation prompt after it
            "if": {"required": ["continue_final_message"], "properties": {"continue_final_message": {"const": True}}},
            "then": {"required": ["add_generation_prompt"], "properties": {"add_generation_prompt": {"const": False}}},
        }
    )

    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the chat template writes them (vLLM's default)
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[Int(ge=0)]


def add_tokenizer_routes(app: FastAPI, engine: EngineClient, check_model: Callable[[str | None], object]) -> None:
    inputs = engine.inputs
    tokenizer = inputs.tokenizer

    def tokenized(body: TokenizeCompletionRequest | TokenizeChatRequest) -> dict:
        if isinstance(body, TokenizeChatRequest):
            messages = [m.as_template_message() for m in body.messages]
            text = inputs.chat(
                messages, body.add_generation_prompt, None, body.continue_final_message, within_limits=False
            )["prompt"]
        else:
            text = body.prompt
        ids = tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
        out = {"count": len(ids), "max_model_len": inputs.max_model_len, "tokens": ids}
        return out | ({"token_strs": tokenizer.convert_ids_to_tokens(ids)} if body.return_token_strs else {})

    @app.post("/tokenize", responses=ERROR_RESPONSES)
    async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest) -> dict:
        """A prompt's token ids, or a conversation's through the chat template (vLLM's shape)."""
        check_model(body.model)
        try:
            return await engine.input_threads.run(tokenized, body)
        except ValueError as e:
            message = str(e)
            raise APIError(400, message, param_of(message) or "messages") from None

    @app.post("/detokenize", responses=ERROR_RESPONSES)
    async def detokenize(body: DetokenizeRequest) -> dict:
        """Token ids back to text, special tokens written out (vLLM's shape)."""
        check_model(body.model)
        if bad := [t for t in body.tokens if t >= inputs.vocab_size]:
            raise APIError(
                400, f"tokens has token ids out of the vocabulary [0, {inputs.vocab_size}): {bad[:5]}", "tokens"
            )
        return {"prompt": await engine.input_threads.run(tokenizer.decode, body.tokens)}

    @app.get("/tokenizer_info", responses=ERROR_RESPONSES)
    async def tokenizer_info() -> dict:
        """The special tokens, the chat template and the context length, for a client that tokenizes here."""
        return {
            "tokenizer_class": "tokenloop",
            "bos_token": tokenizer.bos_token,
            "eos_token": tokenizer.eos_token,
            "pad_token": None,  # none is defined: a client pads with what it likes (its attention never reads it)
            "chat_template": tokenizer.chat_template,
            "model_max_length": inputs.max_model_len,
            "add_bos_token": tokenizer.add_bos_token,
        }
