"""Request fields no part of the gateway knows: accepted and logged once per name, as vLLM does, or refused with
OpenAI's 400 under `--strict-params` (an option `specmesh up` takes too and hands on).

A field is known when a request model declares it, when extensions.py answers for it (a vLLM extension refused
unless neutral, or ignored) or when it belongs to structured output and tool calling.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from services.gateway.aggregate import Api
from services.gateway.errors import bad_request
from services.gateway.extensions import known_names

log = logging.getLogger(__name__)

# Field names logged, at most: each is remembered so that it is logged once, and a client could send thousands of
# new ones per request (memory and log without bound).
MAX_LOGGED_NAMES = 256
SHOWN_CHARS = 80  # of a field name in the log


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--strict-params", action="store_true", default=False,
        help="refuse a request that carries a field the API does not know, with a 400 naming it, as OpenAI does "
        "(default: accept it and log each unknown field name once, as vLLM does)",
    )


def forwarded(args: argparse.Namespace) -> list[str]:
    """The option as the gateway's command line takes it."""
    return ["--strict-params"] if args.strict_params else []


def known_fields(declared: frozenset[str], api: Api) -> frozenset[str]:
    """The fields known on a generation endpoint: its request model's, and those extensions.py answers for."""
    return declared | known_names(api)


class UnknownFields:
    """Finds the fields of a request body that nothing reads; refuses them when strict, else logs each name once."""

    def __init__(self, strict: bool, known: dict[str, frozenset[str]]) -> None:
        """known: by endpoint, the field names something reads (see known_fields)."""
        self._strict = strict
        self._known = known
        self._logged: set[str] = set()

    def check(self, data: dict[str, Any], api: str) -> None:
        unknown = [name for name in data if name not in self._known[api]]
        if not unknown:
            return
        if self._strict:
            raise bad_request(f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0])
        for name in unknown:
            if name in self._logged or len(self._logged) > MAX_LOGGED_NAMES:
                continue
            self._logged.add(name)
            if len(self._logged) > MAX_LOGGED_NAMES:
                log.warning("more unknown request fields are ignored; no more are logged (%d were)", MAX_LOGGED_NAMES)
            else:
                log.warning("ignoring the unknown request field %r (logged once per field name)", name[:SHOWN_CHARS])
