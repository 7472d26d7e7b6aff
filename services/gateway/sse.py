"""Server-sent events exactly as the OpenAI API streams them: `data: <json>` events, then `data: [DONE]`."""

from __future__ import annotations

import orjson
from aiohttp import web

DONE = b"data: [DONE]\n\n"
CONTENT_TYPE = "text/event-stream"


async def open_stream(request: web.Request) -> web.StreamResponse:
    """Sends the 200 and the headers; from here on, failures can only be reported as events."""
    response = web.StreamResponse(
        status=200,
        headers={"Content-Type": CONTENT_TYPE, "Cache-Control": "no-cache", "Connection": "keep-alive"},
    )
    await response.prepare(request)
    return response


async def send_event(response: web.StreamResponse, payload: dict) -> None:
    await response.write(b"data: " + orjson.dumps(payload) + b"\n\n")


async def close_stream(response: web.StreamResponse) -> None:
    await response.write(DONE)
    await response.write_eof()
