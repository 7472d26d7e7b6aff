"""JSON out of the gateway, and back from its store: orjson, and the standard library where orjson refuses or bends a
value JSON allows (an integer past 64 bits, which a client's tool schema may hold and a Responses object echoes:
orjson refuses to write one and reads it back as a float)."""

from __future__ import annotations

import json
from typing import Any

import orjson


def dumps(value: Any) -> bytes:
    try:
        return orjson.dumps(value)
    except TypeError:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def dumps_text(value: Any) -> str:
    """As aiohttp's json_response takes its serializer."""
    return dumps(value).decode()


def loads(data: bytes) -> Any:
    """What dumps wrote, exactly: orjson's reading, unless it holds a float past 64-bit integers, which may be such
    an integer orjson bent; the standard library then reads it again (a float that large reads the same)."""
    value = orjson.loads(data)
    return json.loads(data) if _has_float_past_int64(value) else value


def _has_float_past_int64(value: Any) -> bool:
    if isinstance(value, float):
        return abs(value) >= 2**63
    if isinstance(value, dict):
        return any(_has_float_past_int64(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_float_past_int64(v) for v in value)
    return False
