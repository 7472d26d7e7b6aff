"""A client that hangs up is routine, not an error: one DEBUG line, no traceback.

A handler writing to a connection its client has closed raises ConnectionResetError. Left to aiohttp, that is
"Error handling request" at ERROR with the whole traceback, once per disconnect. The request's clean-up (the
Cancel into the mesh) has already run in the handler's own `finally` by the time the error gets here.
"""

from __future__ import annotations

import logging

from aiohttp import web

from services.gateway.metrics import Handler

log = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client gone before its answer; it reaches nobody, only access logs


@web.middleware
async def quiet_disconnects(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Outermost middleware: it sees the disconnects every other middleware passes on."""
    try:
        return await handler(request)
    except ConnectionResetError as exc:
        log.debug("client %s left during %s %s: %s", request.remote, request.method, request.path, exc)
        response = web.Response(status=CLIENT_CLOSED_REQUEST)
        response.force_close()
        return response
