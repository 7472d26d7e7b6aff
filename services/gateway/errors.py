"""OpenAI-shaped error bodies, and the middleware that guarantees every failure leaves as one.

Every error the gateway returns is `{"error": {"message", "type", "param", "code"}}` with a fitting status:
bad input is a 4xx naming the parameter when there is one, and only a bug in the gateway is a 500.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import Any

import orjson
from aiohttp import web
from pydantic import BaseModel, ValidationError

from services.gateway import metrics
from services.gateway.metrics import Handler

log = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
NOT_FOUND = "not_found_error"
SERVER_ERROR = "server_error"
UNAVAILABLE = "service_unavailable_error"
TIMEOUT = "timeout_error"
RATE_LIMIT = "requests"  # OpenAI's error type for a limit on requests (rather than tokens)

MODEL_NOT_FOUND = "model_not_found"
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"

VALUE_ERROR_PREFIX = "Value error, "  # pydantic's prefix on messages of ValueErrors raised in validators
QUOTES_VALUE = "got "  # how this gateway's validators quote the bad value in their messages
SHOWN_VALUE_CHARS = 80  # how much of a bad value an error message quotes
MAX_ERRORS_READ = 64  # of one body's, for the union members beside the first (a body may hold thousands)
BUILTIN_TYPES = frozenset({"str", "int", "float", "bool", "dict", "list", "none", "bytes"})  # as pydantic names them



class OpenAIError(Exception):
    """A failure the client should see as-is; raised anywhere in a handler, rendered by the middleware."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})  # e.g. Retry-After on a 503 or 429

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        metrics.REQUEST_ERRORS.labels(self.type).inc()
        return web.json_response(self.body(), status=self.status, headers=self.headers, dumps=_dumps)


def _dumps(obj: object) -> str:
    return orjson.dumps(obj).decode()


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(
        404, f"The model '{model}' does not exist", type=NOT_FOUND, param="model", code=MODEL_NOT_FOUND
    )


def param_name(loc: tuple[int | str, ...], body: Any = None) -> str | None:
    """("messages", 1, "role") -> "messages.[1].role", the way the OpenAI API names nested parameters; the members of
    a union pydantic names on the way ("tool_choice.literal['none','auto']", "input.str") are left out, unless the
    request `body`, where known, holds that key there (a client's metadata key "str")."""
    return ".".join(_param_parts(loc, body)) or None


def _param_parts(loc: tuple[int | str, ...], body: Any = None) -> list[str]:
    parts, at = [], body
    for part in loc:
        if isinstance(part, int):
            parts.append(f"[{part}]")
            at = at[part] if isinstance(at, list) and -len(at) <= part < len(at) else None
        elif isinstance(at, dict) and part in at:  # a key the client wrote
            parts.append(part)
            at = at[part]
        elif not _union_member(part):
            parts.append(part)
            at = None
    return parts


def _union_member(part: int | str) -> bool:
    """Whether a location part names a union's member type rather than a field or a key the client chose: a type's
    spelling (`str`, `list[...]`, `literal[...]`) or a request model's class name."""
    return isinstance(part, str) and ("[" in part or part in BUILTIN_TYPES or part in _model_names())


@functools.cache
def _model_names() -> frozenset[str]:
    """The class names of the pydantic models loaded when the first error is reported (the request models among
    them: the gateway imports them first), as union members appear."""
    names, stack = set(), [BaseModel]
    while stack:
        for model in stack.pop().__subclasses__():
            if model.__name__ not in names:
                names.add(model.__name__)
                stack.append(model)
    return frozenset(names)


def _shown(value: object) -> str:
    """The bad value as the message quotes it: JSON, cut short."""
    try:
        text = orjson.dumps(value, default=repr).decode()
    except TypeError:  # orjson refuses integers past 64 bits, which a JSON body may hold
        text = repr(value)
    return text if len(text) <= SHOWN_VALUE_CHARS else text[: SHOWN_VALUE_CHARS - 3] + "..."


def parsed_body(raw: bytes) -> Any:
    """A request's JSON for from_validation_error to read the client's keys in; None where it does not parse."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None


def from_validation_error(exc: ValidationError, body: Any = None) -> OpenAIError:
    """Reports the first bad field and the value it had; the client fixes one thing at a time anyway. Of a union's
    members' complaints about that place, the one that reached deepest into it (a dict that missed a key, not the
    string member's complaint that it is no string). `body`: the request's JSON, where known, to tell the keys a
    client chose from the union members pydantic names."""
    errors = exc.errors(include_url=False)
    place = _param_parts(tuple(errors[0]["loc"]), body)
    first = errors[0]
    for error in errors[1 : MAX_ERRORS_READ]:  # a union's members report side by side, right after the first
        parts = _param_parts(tuple(error["loc"]), body)
        if parts[: len(place)] == place and len(parts) > len(_param_parts(tuple(first["loc"]), body)):
            first = error
    param = param_name(tuple(first["loc"]), body)
    message = first["msg"].removeprefix(VALUE_ERROR_PREFIX)
    if first["type"] == "missing":
        text = f"Missing required parameter: '{param}'."
    elif param is None:
        text = f"Invalid request body: {message}"
    elif QUOTES_VALUE in message:  # the validator named the value itself
        text = f"Invalid value for '{param}': {message}"
    else:
        text = f"Invalid value for '{param}': {message}, got {_shown(first['input'])}"
    return bad_request(text, param=param)


def _from_http_exception(exc: web.HTTPException) -> OpenAIError:
    if exc.status == web.HTTPNotFound.status_code:
        return OpenAIError(exc.status, "Not found: no such endpoint", type=NOT_FOUND)
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(exc.allowed_methods))
        return OpenAIError(exc.status, f"Method {exc.method} not allowed; allowed: {allowed}")
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return OpenAIError(exc.status, f"Request body too large: {exc.text}")
    return OpenAIError(exc.status, exc.reason, type=INVALID_REQUEST if exc.status < 500 else SERVER_ERROR)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turns whatever escapes a handler into an OpenAI error body; unexpected exceptions are logged as bugs."""
    try:
        return await handler(request)
    except OpenAIError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _from_http_exception(exc).response()
    except ConnectionResetError:
        raise  # the client went away: there is nobody to answer
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return OpenAIError(500, "Internal server error", type=SERVER_ERROR).response()
