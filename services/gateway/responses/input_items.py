"""GET /v1/responses/{id}/input_items: a stored response's input, as OpenAI lists it: each item with an id, message
content as parts, paged by `limit`, `order` and `after`."""

from __future__ import annotations

import uuid
from typing import Any

from services.gateway.errors import bad_request

DEFAULT_LIMIT, MAX_LIMIT = 20, 100
ORDERS = ("asc", "desc")
STATUS_ITEMS = ("message", "function_call", "function_call_output")  # item types whose listing has a status
ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def listed_items(given: Any) -> list[dict[str, Any]]:
    """The request's `input` as a stored response lists it: a string is one user message; a message's string content
    becomes one text part; an item without an id or status gets one."""
    items = [{"type": "message", "role": "user", "content": given}] if isinstance(given, str) else given
    listed = []
    for item in items:
        item = {"type": "message", **item}
        if item["type"] == "message":
            content = item.get("content")
            if isinstance(content, str):
                part = "output_text" if item.get("role") == "assistant" else "input_text"
                content = [{"type": part, "text": content}]
            item["content"] = [_part(part) for part in content]
        if item["type"] in STATUS_ITEMS and item.get("status") is None:
            item["status"] = "completed"
        item.setdefault("id", f"{ID_PREFIX.get(item['type'], 'item')}_{uuid.uuid4().hex}")
        listed.append(item)
    return listed


def _part(part: dict[str, Any]) -> dict[str, Any]:
    """An output text part as OpenAI's types have it: with its (empty) annotations."""
    if part.get("type") == "output_text" and part.get("annotations") is None:
        return {**part, "annotations": []}
    return part


def page(items: list[dict[str, Any]], query: dict[str, str]) -> dict[str, Any]:
    """One page of the items under the query's `limit` (1-100, 20), `order` (desc: the last item first) and `after`
    (an item id: the page starts past it)."""
    order = query.get("order", "desc")
    if order not in ORDERS:
        raise bad_request(f"order must be one of {', '.join(ORDERS)}, got {order!r}", param="order")
    try:
        limit = int(query.get("limit", DEFAULT_LIMIT))
    except ValueError:
        raise bad_request(f"limit must be an integer, got {query['limit']!r}", param="limit") from None
    if not 1 <= limit <= MAX_LIMIT:
        raise bad_request(f"limit must be between 1 and {MAX_LIMIT}, got {limit}", param="limit")
    ordered = items if order == "asc" else items[::-1]
    if (after := query.get("after")) is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise bad_request(f"No input item with id '{after}' in this response.", param="after")
        ordered = ordered[ids.index(after) + 1 :]
    data = ordered[:limit]
    return {
        "object": "list", "data": data, "has_more": len(ordered) > limit,
        "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None,
    }
