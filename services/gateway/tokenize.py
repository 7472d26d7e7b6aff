"""vLLM's POST /tokenize and /detokenize: a prompt as the model's tokens (a text, or a chat rendered by the model's
chat template exactly as /v1/chat/completions renders it), and tokens back as text. The gateway's own tokenizer
answers; no worker is asked. Clients count a prompt's tokens against max_model_len with it before they send it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.gateway.chat_request import ChatMessage
from services.gateway.errors import bad_request, from_validation_error, parsed_body, model_not_found
from services.gateway.generation import Generator
from services.gateway.request_body import read_object
from shared.tokenizer import Tokenizer


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class TokenizeText(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(_Strict):
    """The fields of a chat completion that decide its prompt."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class Detokenize(_Strict):
    model: str | None = None
    tokens: list[int]


class Tokenization:
    def __init__(self, generator: Generator, tokenizer: Tokenizer, model: str, max_model_len: int) -> None:
        self._generator = generator
        self._tokenizer = tokenizer
        self._model = model
        self._max_model_len = max_model_len

    async def tokenize(self, request: web.Request) -> web.Response:
        raw, data = await read_object(request)
        body = _validated(TokenizeChat if "messages" in data else TokenizeText, raw)
        self._check_model(body.model)
        if isinstance(body, TokenizeChat):
            chat = self._generator.bodies.chat(
                {"model": self._model, **body.model_dump(exclude={"model", "return_token_strs"}, exclude_none=True)}
            )
            ids = (await self._generator.prompt_token_ids(chat))[0]
        else:  # on a thread, as a generation request's prompt: a long text would hold up every stream meanwhile
            ids = await asyncio.to_thread(self._tokenizer.encode, body.prompt, body.add_special_tokens)
        strs = await asyncio.to_thread(self._tokenizer.token_strs, ids) if body.return_token_strs else None
        return web.json_response(
            {"count": len(ids), "max_model_len": self._max_model_len, "tokens": ids, "token_strs": strs}
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        body = _validated(Detokenize, (await read_object(request))[0])
        self._check_model(body.model)
        vocab = self._tokenizer.vocab_size
        if bad := [t for t in body.tokens if not 0 <= t < vocab]:
            raise bad_request(f"Token id {bad[0]} is out of vocabulary (vocabulary size {vocab})", param="tokens")
        text = await asyncio.to_thread(self._tokenizer.decode, body.tokens, False)
        return web.json_response({"prompt": text})

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self._model:
            raise model_not_found(model)


def _validated(model: type[_Strict], raw: bytes) -> Any:
    try:  # the raw JSON: strict mode is JSON's
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise from_validation_error(exc, parsed_body(raw)) from exc
