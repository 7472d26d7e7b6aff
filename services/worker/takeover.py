"""Taking over a request another worker lost, from the output its client has already been sent.

A work-queue message reaches a worker a second time when the worker that had it died or went silent past ack_wait
(JetStream delivers it again), and a request comes back as a new message when a draining worker hands it back. Only
the request's detokenizer knows for sure how far its output got: this worker asks it (ProgressQuery), and continues
each unfinished choice from the tokens and record number it answers, with the request's seed (the gateway fixes one
for every sampled request), so the stream goes on as if nothing had happened. The detokenizer takes the request's
frames from this worker only from then on, counts the migration, and refuses one past its --max-migrations.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import StrEnum

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from pydantic import ValidationError

from shared import subjects
from shared.schemas import HandoffTicket, ProgressQuery, ProgressReport, TakeOver, WorkRequest

log = logging.getLogger("specmesh.worker")

PROGRESS_TIMEOUT_S = 2.0  # a live detokenizer answers at once; a busy one still well inside this
RETRY_DELAY_S = 1.0  # a request whose detokenizer did not answer comes back to some worker after this long


class Outcome(StrEnum):
    """What becomes of a request that came back (also the `outcome` label of the worker's take-over counter)."""

    CONTINUED = "continued"  # runs here from where its output stands
    CLOSED = "closed"  # over at its detokenizer: acknowledged, nothing to run
    REFUSED = "refused"  # lost its worker too often: ended with an error by its detokenizer; terminated
    # Neither comes back at once: handed back to the queue for another try after RETRY_DELAY_S. A detokenizer that is
    # not on NATS may be on its way back after a NATS restart; one that is gone makes its gateway end the stream and
    # cancel the request, which every worker then drops (or JetStream gives up on it after max_deliver tries).
    NO_DETOKENIZER = "no_detokenizer"  # nobody listens on its detokenizer's subject
    NO_ANSWER = "no_answer"  # its detokenizer did not answer in time


@dataclass(frozen=True)
class TakenOver:
    outcome: Outcome
    request: WorkRequest | None = None  # with CONTINUED: the request with each unfinished choice's progress
    migrations: int = 0


def came_back(msg: Msg, request: WorkRequest) -> bool:
    """Whether another worker had this request before: delivered again, handed back with its progress, or moved
    from a routed queue after a delivery there (services/worker/routing.py)."""
    delivered_before = bool(msg.headers and msg.headers.get(subjects.DELIVERED_BEFORE_HEADER))
    return msg.metadata.num_delivered > 1 or bool(request.progress) or delivered_before


def delivery_id(msg: Msg) -> str:
    """The identity of a work-queue message, the same on every delivery of it: its stream and sequence there, or,
    for a routed message moved to the shared queue, those of the routed message it was."""
    if msg.headers and (moved_from := msg.headers.get(subjects.DELIVERY_HEADER)):
        return moved_from
    return f"{msg.metadata.stream}:{msg.metadata.sequence.stream}"


async def take_over(
    nc: Client, request: WorkRequest, worker_id: int, delivery: str, handoff: HandoffTicket | None = None
) -> TakenOver:
    """Asks the request's detokenizer where its output stands and makes this worker the one it takes frames from.
    `delivery` names the message taken (delivery_id); `handoff`, the ticket of a decode worker taking a request its
    prefill worker handed it."""
    query = ProgressQuery(
        request_id=request.request_id, worker_id=worker_id, delivery=delivery,
        handoff_from=handoff.from_worker if handoff is not None else None,
        superseded=handoff.superseded if handoff is not None else None,
    )
    try:
        reply = await nc.request(subjects.progress(request.detok_id), query.to_bytes(), timeout=PROGRESS_TIMEOUT_S)
    except nats.errors.NoRespondersError:
        return TakenOver(Outcome.NO_DETOKENIZER)
    except nats.errors.Error as exc:  # no answer in time, or NATS out
        log.warning("no progress for request %s from its detokenizer %s: %r", request.request_id, request.detok_id, exc)
        return TakenOver(Outcome.NO_ANSWER)
    try:
        report = ProgressReport.from_bytes(reply.data)
    except (ValidationError, ValueError) as exc:
        log.error("unreadable progress report for request %s: %s", request.request_id, exc)
        return TakenOver(Outcome.NO_ANSWER)
    if report.outcome is TakeOver.CLOSED:
        return TakenOver(Outcome.CLOSED, migrations=report.migrations)
    if report.outcome is TakeOver.REFUSED:
        return TakenOver(Outcome.REFUSED, migrations=report.migrations)
    if not report.progress:
        return TakenOver(Outcome.CLOSED, migrations=report.migrations)  # every choice has ended there
    resumed = request.model_copy(update={"progress": report.progress})
    return TakenOver(Outcome.CONTINUED, WorkRequest.model_validate(resumed.model_dump()), report.migrations)
