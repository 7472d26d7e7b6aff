"""Requests moving between workers, as their detokenizer sees it.

A worker that takes over a request another worker lost (it died, stalled past the work queue's ack_wait, or drained
and handed the request back) cannot know how far the output got: the frames the previous worker sent last may or may
not have arrived. The detokenizer knows, since it consumed them: it answers the new worker's ProgressQuery with each
unfinished choice's tokens and next TARGET record number, and from then on takes the request's frames from the new
worker only (RequestChoices.owner). The new worker recomputes the cache from those tokens and continues with the same
seed, so the client's stream goes on with no token missing or doubled.

Each take-over is a migration. A request that keeps losing its worker (one that kills every worker it reaches, or a
mesh in trouble) is ended here with an error after --max-migrations of them, and its worker told to drop it.
"""

from __future__ import annotations

import argparse
import logging

from prometheus_client import Counter

from services.detokenizer.choices import RequestChoices
from shared.natsutil import REQUEST_MAX_DELIVER
from shared.schemas import Chunk, ProgressQuery, ProgressReport, TakeOver

log = logging.getLogger(__name__)

DEFAULT_MAX_MIGRATIONS = 3
# The first delivery and one whose detokenizer did not answer (the worker asks again later) are no migrations.
MAX_MIGRATIONS = REQUEST_MAX_DELIVER - 2

MIGRATIONS = Counter(
    "specmesh_detokenizer_migrations", "Requests taken over by another worker, continuing from the output sent"
)
MIGRATIONS_REFUSED = Counter(
    "specmesh_detokenizer_migrations_refused", "Requests ended with an error for losing their worker too often"
)
HANDOFFS = Counter(
    "specmesh_detokenizer_handoffs", "Requests a decode worker took from their prefill worker (not migrations)"
)
STALE_RECORDS = Counter(
    "specmesh_detokenizer_stale_records", "Frame records dropped because another worker had taken their request over"
)
RELEASES = Counter(
    "specmesh_detokenizer_releases", "Workers told to drop a request they still ran after another took it over"
)


class Migrations:
    """Answers take-over queries; counts and bounds migrations per request."""

    def __init__(self, max_migrations: int = DEFAULT_MAX_MIGRATIONS) -> None:
        if max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {max_migrations}")
        self.max_migrations = max_migrations

    def take_over(self, request: RequestChoices | None, query: ProgressQuery) -> tuple[ProgressReport, Chunk | None]:
        """The answer to the querying worker, and the error chunk to send when the request is given up on."""
        if request is None:
            return ProgressReport(outcome=TakeOver.CLOSED), None
        if query.delivery is not None and query.delivery in request.superseded:
            # The prefill worker died after handing the request off, before acknowledging its own delivery: the
            # request lives on where it was handed, and this delivery of it is over.
            log.info("request %s: worker %d took a delivery its handoff replaced; closed", query.request_id,
                     query.worker_id)
            return ProgressReport(outcome=TakeOver.CLOSED, migrations=request.migrations), None
        if query.superseded in request.taken_through and query.handoff_from != request.owner:
            # The other order of the same race: the prefill worker's delivery came back to a worker that took it
            # over before its handoff's decode worker asked. That worker continues the request; the decode worker
            # drops it, rather than take it over again and leave both running it. (A handoff from the owner is the
            # owner's own: a prefill worker handing on a request it took over.)
            log.info("request %s: worker %d took the delivery handed to worker %d first; closed for the latter",
                     query.request_id, request.owner, query.worker_id)
            return ProgressReport(outcome=TakeOver.CLOSED, migrations=request.migrations), None
        if query.superseded in request.superseded and request.superseded[query.superseded] != query.delivery:
            # A second handoff of a delivery already handed on (a routed publish whose answer was lost, sent again
            # to another decode worker): the first one runs the request. (The first handoff's own message, come back
            # because its worker died or gave up asking, is a take-over like any other.)
            log.info("request %s: worker %d got a handoff another worker took first; closed", query.request_id,
                     query.worker_id)
            return ProgressReport(outcome=TakeOver.CLOSED, migrations=request.migrations), None
        if query.superseded is not None:
            request.superseded.setdefault(query.superseded, query.delivery)
        if query.handoff_from is not None and request.owner in (None, query.handoff_from):
            HANDOFFS.inc()
            progress = request.take_over(query.worker_id, query.delivery, migration=False)
            log.debug("request %s handed to worker %d at %s tokens", query.request_id, query.worker_id,
                      [len(p.output_token_ids) for p in progress])
            return ProgressReport(outcome=TakeOver.CONTINUE, progress=progress, migrations=request.migrations), None
        if request.migrations >= self.max_migrations:
            MIGRATIONS_REFUSED.inc()
            error = (
                f"the request lost its worker {request.migrations + 1} times; it is not moved to another worker more "
                f"than {self.max_migrations} times (--max-migrations)"
            )
            return ProgressReport(outcome=TakeOver.REFUSED, migrations=request.migrations), request.fail(error)
        previous = request.owner
        progress = request.take_over(query.worker_id, query.delivery)
        MIGRATIONS.inc()
        log.info(
            "request %s taken over by worker %d from worker %s (migration %d) at %s tokens", query.request_id,
            query.worker_id, previous, request.migrations, [len(p.output_token_ids) for p in progress],
        )
        return ProgressReport(outcome=TakeOver.CONTINUE, progress=progress, migrations=request.migrations), None


def max_migrations_arg(text: str) -> int:
    """--max-migrations: a count, 0 included (a request whose worker dies then ends with an error at once), up to
    what the work queue delivers a message: each take-over is a redelivery, and one is kept for a delivery whose
    detokenizer did not answer. More would be a bound JetStream cuts short with a dead letter."""
    value = int(text)
    if not 0 <= value <= MAX_MIGRATIONS:
        raise argparse.ArgumentTypeError(
            f"must be between 0 and {MAX_MIGRATIONS} (the work queue delivers a request at most "
            f"{REQUEST_MAX_DELIVER} times), got {value}"
        )
    return value
