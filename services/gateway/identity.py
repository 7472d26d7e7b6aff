"""Who a request comes from, for per-client limits and fairness (admission.py).

A client is its API key when the gateway checks keys: the key is then proven, and one holder may use it from many
addresses. Otherwise a bearer token proves nothing (a client could send a new one with every request to escape
its limit), so the client is its peer address. The key is kept only as a digest, so it never sits in the
admission tables or in a log line.
"""

from __future__ import annotations

import hashlib

from aiohttp import web

from services.gateway.auth import BEARER_SCHEME

KEY_DIGEST_CHARS = 16  # hex digits of the key's SHA-256 that name the client
UNKNOWN_PEER = "unknown"  # a peer address aiohttp cannot tell (e.g. a Unix socket)


def client_identity(request: web.Request, keys_checked: bool) -> str:
    """"key:<digest>" or "peer:<address>"; with keys checked, auth.py has already refused any other header."""
    scheme, _, key = request.headers.get("Authorization", "").partition(" ")
    if keys_checked and scheme.lower() == BEARER_SCHEME:
        return "key:" + hashlib.sha256(key.strip().encode()).hexdigest()[:KEY_DIGEST_CHARS]
    return "peer:" + (request.remote or UNKNOWN_PEER)
