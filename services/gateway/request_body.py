"""Reading a generation request's body: JSON, then vLLM's undeclared extensions (extensions.py) and unknown fields
(unknown_fields.py) on the raw object, then the endpoint's request model, so that no field is dropped unseen."""

from __future__ import annotations

import orjson
from aiohttp import web
from pydantic import ValidationError

from services.gateway.aggregate import Api
from services.gateway.chat_request import ChatCompletionRequest
from services.gateway.completion_request import CompletionRequest
from services.gateway.errors import bad_request, from_validation_error
from services.gateway.extensions import Extensions
from services.gateway.protocol import MAX_N_CONTEXT
from services.gateway.unknown_fields import UnknownFields

REQUEST_MODELS = {"chat": ChatCompletionRequest, "completion": CompletionRequest}


class RequestBodies:
    """Parses request bodies for one gateway: its --max-n and --strict-params, and the field names it logged."""

    def __init__(self, max_n: int, strict_params: bool) -> None:
        self._max_n = max_n
        self._extensions = Extensions()
        declared = {api: frozenset(model.model_fields) for api, model in REQUEST_MODELS.items()}
        self._unknown_fields = UnknownFields(strict_params, declared)

    async def parse(self, request: web.Request, api: Api) -> ChatCompletionRequest | CompletionRequest:
        raw = await request.read()  # raises 413 past the app's client_max_size
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise bad_request(f"The request body is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise bad_request("The request body must be a JSON object")
        self._extensions.check(data, api)
        self._unknown_fields.check(data, api)
        try:  # the raw JSON, not `data`: the models' strict mode is JSON's (a list may fill a tuple)
            return REQUEST_MODELS[api].model_validate_json(raw, context={MAX_N_CONTEXT: self._max_n})
        except ValidationError as exc:
            raise from_validation_error(exc) from exc
