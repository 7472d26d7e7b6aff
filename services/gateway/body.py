"""The request body, bounded before anything parses it: by its declared size, its size, and the time it takes.

A Content-Length over the limit is refused before a byte of the body is read; a body that arrives slower than the
body timeout (one byte a second, say) is cut off with 408 and its connection closed, so a slow client cannot hold
a handler, a connection and a growing buffer for as long as it likes. Requests without a body pass untouched.
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.typedefs import Middleware

from services.gateway import metrics
from services.gateway.errors import TIMEOUT, OpenAIError
from services.gateway.metrics import Handler

PAYLOAD_TOO_LARGE = 413
REQUEST_TIMEOUT = 408


def _closing(error: OpenAIError) -> web.Response:
    """The error's response, on a connection that closes after it: the rest of the body is not worth reading."""
    response = error.response()
    response.force_close()
    return response


def body_limits(max_bytes: int, timeout_s: float) -> Middleware:
    """A middleware that reads every request body whole, within `timeout_s` and `max_bytes`, before the handler
    runs (the handler's request.read() then returns it at once)."""

    @web.middleware
    async def read_body(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not request.body_exists:
            return await handler(request)
        declared = request.content_length
        if declared is not None and declared > max_bytes:
            metrics.BODY_REFUSED.labels("too_large").inc()
            return _closing(
                OpenAIError(
                    PAYLOAD_TOO_LARGE, f"Request body too large: Content-Length {declared} exceeds {max_bytes} bytes"
                )
            )
        try:
            async with asyncio.timeout(timeout_s):
                await request.read()  # past max_bytes (a body without Content-Length) this raises 413
        except TimeoutError:
            metrics.BODY_REFUSED.labels("too_slow").inc()
            return _closing(
                OpenAIError(REQUEST_TIMEOUT, f"The request body did not arrive within {timeout_s:g} s", type=TIMEOUT)
            )
        return await handler(request)

    return read_body
