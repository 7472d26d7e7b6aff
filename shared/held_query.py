"""The one question gateways and detokenizers ask each other about their requests: of these, which do you still
hold (a HeldQuery, answered by a HeldReport)? A gateway asks the detokenizers of a silent stream
(services/gateway/liveness.py); a detokenizer asks the gateways of its open requests (services/detokenizer/gateways.py).
Each reads the answers its own way; NATS's "no responders" says nobody subscribes to the subject asked."""

from __future__ import annotations

import logging

import nats.errors
from nats.aio.client import Client
from pydantic import ValidationError

from shared.schemas import HeldQuery, HeldReport

log = logging.getLogger(__name__)


class NobodyListens(Exception):
    """No one subscribes to the subject asked: the one who would answer is gone (or not yet, or no longer, there)."""


async def ask_held(nc: Client, subject: str, request_ids: list[str], timeout_s: float) -> set[str] | None:
    """Those of the requests the one asked on `subject` holds; None when no answer came in time (or NATS is out) or
    the answer is not a HeldReport. Raises NobodyListens."""
    query = HeldQuery(request_ids=tuple(request_ids)).to_bytes()
    try:
        reply = await nc.request(subject, query, timeout=timeout_s)
    except nats.errors.NoRespondersError:
        raise NobodyListens(subject) from None
    except nats.errors.Error:
        return None
    try:
        return set(HeldReport.from_bytes(reply.data).request_ids)
    except (ValidationError, ValueError) as exc:
        log.warning("the answer on %s is not a HeldReport: %s", subject, exc)
        return None
