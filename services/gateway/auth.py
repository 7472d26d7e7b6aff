"""API keys: where they come from (--api-key, SPECMESH_API_KEY or vLLM's VLLM_API_KEY, --api-key-file) and the
middleware that checks them.

Every route but the open ones (health, readiness, metrics) needs `Authorization: Bearer <key>` with one of the
keys; anything else gets OpenAI's 401. The presented key is compared with every key, each in constant time
(hmac.compare_digest over SHA-256 digests, so that lengths do not show either), and no key is ever logged.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path

from aiohttp import web
from pydantic import SecretStr

from services.gateway.errors import INVALID_REQUEST, OpenAIError
from services.gateway.metrics import Handler
from services.startup_checks import UsageError

API_KEY_ENV = "SPECMESH_API_KEY"  # one key, or several separated by KEY_SEPARATOR
# vLLM's variable: one key, taken as vLLM takes it, only when no other source gives one (its --api-key replaces it,
# so a key rotated on the command line does not leave the old one working); read so that it never leaves a server open
VLLM_API_KEY_ENV = "VLLM_API_KEY"
API_KEY_ENVS = (API_KEY_ENV, VLLM_API_KEY_ENV)
KEY_SEPARATOR = ","
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})  # probes and scrapers carry no key
AUTHORIZATION = "Authorization"
BEARER_SCHEME = "bearer"  # compared case-insensitively, as HTTP auth schemes are
INVALID_API_KEY = "invalid_api_key"
UNAUTHORIZED = 401


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The key options of the gateway and of `specmesh up`, which hands the keys to its gateway."""
    parser.add_argument(
        "--api-key", action="append", default=[], metavar="KEY",
        help=f"a key clients must send as 'Authorization: Bearer KEY'; repeat for several (also {API_KEY_ENV}, "
        f"comma-separated; {VLLM_API_KEY_ENV} when no other key is given). Without any key, no key is asked for",
    )
    parser.add_argument("--api-key-file", type=Path, default=None, help="a file of API keys, one per line")


def parse_api_keys(given: Iterable[str], key_file: Path | None, environ: Mapping[str, str]) -> tuple[SecretStr, ...]:
    """The keys from --api-key (repeatable), the environment and --api-key-file (one per line, blank lines
    ignored), without repeats. A malformed key is refused by where it came from, never by its value."""
    sources = [("--api-key", key) for key in given]
    sources += [(API_KEY_ENV, key) for key in environ.get(API_KEY_ENV, "").split(KEY_SEPARATOR) if key.strip()]
    if key_file is not None:
        try:
            lines = Path(key_file).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"--api-key-file {key_file}: {exc}") from exc
        sources += [(f"--api-key-file {key_file} line {n}", line.strip()) for n, line in enumerate(lines, 1)
                    if line.strip()]
    if not sources and environ.get(VLLM_API_KEY_ENV, "").strip():
        sources = [(VLLM_API_KEY_ENV, environ[VLLM_API_KEY_ENV].strip())]
    for source, key in sources:
        if not key.isascii() or not key.isprintable() or any(c.isspace() for c in key) or KEY_SEPARATOR in key:
            raise UsageError(f"{source}: an API key must be printable ASCII without spaces or commas")
    return tuple(SecretStr(key) for key in dict.fromkeys(key for _, key in sources))


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def missing_key() -> OpenAIError:
    return OpenAIError(
        UNAUTHORIZED,
        "You didn't provide an API key. Send it in an Authorization header: 'Authorization: Bearer YOUR_KEY'.",
        type=INVALID_REQUEST, code=INVALID_API_KEY,
    )


def wrong_key() -> OpenAIError:
    return OpenAIError(UNAUTHORIZED, "Incorrect API key provided.", type=INVALID_REQUEST, code=INVALID_API_KEY)


def require_api_key(keys: tuple[SecretStr, ...]) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """The middleware that refuses requests without one of `keys`; place it inside error_middleware."""
    digests = [_digest(key.get_secret_value()) for key in keys]

    @web.middleware
    async def check_api_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in OPEN_PATHS:
            return await handler(request)
        scheme, _, token = request.headers.get(AUTHORIZATION, "").partition(" ")
        token = token.strip()
        if scheme.lower() != BEARER_SCHEME or not token:
            return _unauthorized(missing_key())
        presented = _digest(token)
        matched = False
        for digest in digests:  # every key is compared, whichever matches
            matched |= hmac.compare_digest(presented, digest)
        if not matched:
            return _unauthorized(wrong_key())
        return await handler(request)

    return check_api_key


def _unauthorized(error: OpenAIError) -> web.Response:
    response = error.response()
    response.headers["WWW-Authenticate"] = "Bearer"  # RFC 6750: the scheme the client should use
    return response
