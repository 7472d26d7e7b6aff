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


def event(payload: dict) -> bytes:
    """One event, serialized once; events that leave together are joined into one write."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


async def write_caught_up(response: web.StreamResponse, unsent: list[bytes], more_ready: bool) -> None:
    """Writes the events waiting once no chunk is ready behind them (`more_ready`): a gateway behind its detokenizers
    catches up with one write (a system call) per client instead of one per chunk; nothing waits for a chunk that
    has not arrived."""
    if not more_ready:
        await response.write(b"".join(unsent))
        unsent.clear()


async def close_stream(response: web.StreamResponse, last: list[bytes]) -> None:
    """Writes the last events and [DONE] with the end of the response, in one write."""
    await response.write_eof(b"".join([*last, DONE]))
