"""A tool call as every format parses it, and what the formats share to write one: the JSON schema a forced call
follows, the arguments' text, the call's id."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from services.gateway.tools.tool_request import FunctionDefinition
from shared.json_schema import embedded

COMPACT = {"whitespace_flexible": False}
JSON_PREFIX = json.JSONDecoder()  # raw_decode: the JSON value a text begins with, whatever follows it


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI's tool_calls carry it


def call_schema(functions: list[FunctionDefinition], arguments_key: str) -> dict[str, Any]:
    """One call of any of `functions` as a JSON object, `name` first, written compact. A function's schema with
    references moves under the root's definitions, named after it, where they find what they point to
    (shared/json_schema.py)."""
    options, definitions = [], {}
    for f in functions:
        arguments, own = embedded(f.schema, f.name)
        definitions |= own
        options.append({
            "type": "object",
            "properties": {"name": {"const": f.name}, arguments_key: arguments},
            "required": ["name", arguments_key],
            "additionalProperties": False,
        })
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, **({"$defs": definitions} if definitions else {}), "x-guidance": COMPACT}


def json_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


ARGUMENT_KEYS = ("arguments", "parameters")  # what models name a call's arguments, whatever their format says


def parsed_call(obj: Any, arguments_key: str) -> ParsedCall | None:
    """The call a JSON object is: its arguments under the format's key, else under the other name models use."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = next((k for k in (arguments_key, *ARGUMENT_KEYS) if k in obj), None)
    return ParsedCall(obj["name"], json_text(obj[key] if key is not None else {}))


class CallIds:
    """The ids of the calls a format parses: OpenAI's shape, which a chat template takes back as it is."""

    def new_call_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    def template_call_id(self, call_id: str) -> str:
        """An earlier call's id as the chat template reads it."""
        return call_id
