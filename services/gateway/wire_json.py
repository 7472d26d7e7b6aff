"""JSON out of the gateway: orjson, and the standard library where orjson refuses a value JSON allows (an integer
past 64 bits, which a client's tool schema may hold and a Responses object echoes)."""

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
