"""Reading a generation request's body (chat, completions, responses): JSON, then vLLM's undeclared extensions
(extensions.py) and unknown fields (unknown_fields.py) on the raw object, then the endpoint's request model, so that no
field is dropped unseen."""

from __future__ import annotations

from typing import Any, TypeVar

import orjson
from pydantic import BaseModel
from aiohttp import web
from pydantic import ValidationError

from services.gateway.aggregate import Api
from services.gateway.chat_request import ChatCompletionRequest
from services.gateway.completion_request import CompletionRequest
from services.gateway import wire_json
from services.gateway.errors import bad_request, from_validation_error, parsed_body
from services.gateway.extensions import Extensions
from services.gateway.protocol import MAX_N_CONTEXT
from services.gateway.responses.request import RESPONSES, RESPONSES_FIELDS, ResponsesRequest, check_refused
from services.gateway.unknown_fields import UnknownFields, known_fields

M = TypeVar("M", bound=BaseModel)
REQUEST_MODELS = {"chat": ChatCompletionRequest, "completion": CompletionRequest}


class RequestBodies:
    """Parses request bodies for one gateway: its --max-n and --strict-params, and the field names it logged."""

    def __init__(self, max_n: int, strict_params: bool) -> None:
        self._max_n = max_n
        self._extensions = Extensions()
        known = {api: known_fields(frozenset(model.model_fields), api) for api, model in REQUEST_MODELS.items()}
        self.unknown_fields = UnknownFields(strict_params, {**known, RESPONSES: RESPONSES_FIELDS})

    async def parse(self, request: web.Request, api: Api) -> ChatCompletionRequest | CompletionRequest:
        raw, data = await read_object(request)
        self._extensions.check(data, api)
        self.unknown_fields.check(data, api)
        return self._validated(REQUEST_MODELS[api], raw)

    async def parse_responses(self, request: web.Request) -> tuple[ResponsesRequest, dict[str, Any]]:
        """A Responses request, and its raw JSON object (where its extensions are read from)."""
        raw, data = await read_object(request)
        check_refused(data)
        self.unknown_fields.check(data, RESPONSES)
        return self._validated(ResponsesRequest, raw), data

    def chat(self, body: dict[str, Any]) -> ChatCompletionRequest:
        """A chat request from a JSON object built by the gateway (a Responses request's, responses/)."""
        return self._validated(ChatCompletionRequest, wire_json.dumps(body))

    def _validated(self, model: type[M], raw: bytes) -> M:
        try:  # the raw JSON, not `data`: the models' strict mode is JSON's (a list may fill a tuple)
            return model.model_validate_json(raw, context={MAX_N_CONTEXT: self._max_n})
        except ValidationError as exc:
            raise from_validation_error(exc, parsed_body(raw)) from exc


async def read_object(request: web.Request) -> tuple[bytes, dict[str, Any]]:
    """The body's bytes and the JSON object they hold; a 400 for anything else."""
    raw = await request.read()  # raises 413 past the app's client_max_size
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object")
    return raw, data
