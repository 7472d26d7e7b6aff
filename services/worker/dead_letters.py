"""Requests the work queue gave up on: delivered max_deliver times and never finished.

A worker terminates every message it refuses or fails (never redelivered), so a message that keeps coming back is
one whose workers died on it or stalled past ack_wait. JetStream stops delivering such a message after the
consumer's max_deliver deliveries, leaves it in the stream and publishes an advisory naming it. The dead-letter
stream stores those advisories, so none is lost while no worker runs. The workers share one durable consumer of
them: for each, a worker copies the request to subjects.DEAD_REQUESTS in the same stream (headers say where it came
from and how often it was delivered), removes it from the work queue, ends it at its detokenizer with an ABORT
record that holds wherever its output stands (shared/frames.WHEREVER), so that its client gets an error rather than
a timeout, and counts it. The stream and its consumer are declared with the others (shared/streams.py).
"""

from __future__ import annotations

import asyncio
import logging

import nats.errors
from nats.aio.client import Client
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import NotFoundError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shared import subjects
from shared.schemas import WorkRequest
from services.worker.metrics import DEAD_LETTERS, WorkerMetrics
from services.worker.publisher import end_wherever_frame

log = logging.getLogger("specmesh.worker")

FETCH_BATCH = 16
FETCH_TIMEOUT_S = 1.0
HEADER_STREAM_SEQ = "Specmesh-Stream-Seq"
HEADER_DELIVERIES = "Specmesh-Deliveries"


class MaxDeliveriesAdvisory(BaseModel):
    """JetStream's io.nats.jetstream.advisory.v1.max_deliver, the fields used here."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    stream: str
    consumer: str
    stream_seq: int = Field(ge=1)
    deliveries: int = Field(ge=1)


class DeadLetters:
    """Moves the requests named by max-deliveries advisories to the dead-letter subject."""

    def __init__(self, nc: Client, worker_id: int, metrics: WorkerMetrics) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.worker_id = worker_id
        self.metrics = metrics

    async def loop(self) -> None:
        """Handles advisories as they come, those stored while no worker ran first; until cancelled."""
        psub = await self.js.pull_subscribe_bind(subjects.DEAD_LETTER_CONSUMER, subjects.DEAD_LETTER_STREAM)
        try:
            while True:
                try:
                    msgs = await psub.fetch(batch=FETCH_BATCH, timeout=FETCH_TIMEOUT_S)
                except (NatsTimeoutError, asyncio.TimeoutError):
                    continue
                for msg in msgs:
                    try:
                        await self.handle(msg.data)
                    except nats.errors.Error as exc:
                        # Unacknowledged, the advisory comes back after the consumer's ack_wait (shared/streams.py),
                        # to this worker or another.
                        log.warning("could not move a dead letter now: %r", exc)
                        continue
                    await msg.ack()
        finally:
            await psub.unsubscribe()

    async def handle(self, raw: bytes) -> None:
        try:
            advisory = MaxDeliveriesAdvisory.model_validate_json(raw)
        except ValidationError as exc:
            log.error("ignoring an unreadable max-deliveries advisory: %s", exc)
            return
        try:
            original = await self.js.get_msg(subjects.REQUEST_STREAM, advisory.stream_seq)
        except NotFoundError:
            return  # finished after all, expired, or moved by a worker that died before acknowledging the advisory
        headers = {
            HEADER_STREAM_SEQ: str(advisory.stream_seq),
            HEADER_DELIVERIES: str(advisory.deliveries),
            subjects.MSG_ID_HEADER: f"{subjects.REQUEST_STREAM}.{advisory.stream_seq}",
        }
        await self.js.publish(subjects.DEAD_REQUESTS, original.data or b"", headers=headers)
        await self.js.delete_msg(subjects.REQUEST_STREAM, advisory.stream_seq)
        self.metrics.child(DEAD_LETTERS).inc()
        try:
            request = WorkRequest.from_bytes(original.data or b"")
        except ValueError as exc:  # orjson's and pydantic's errors are ValueErrors
            log.error("moved message %d to %s after %d deliveries; it is no WorkRequest (%s)",
                      advisory.stream_seq, subjects.DEAD_REQUESTS, advisory.deliveries, exc)
            return
        log.error("moved request %s to %s after %d deliveries", request.request_id, subjects.DEAD_REQUESTS,
                  advisory.deliveries)
        if request.detok_id:
            # The workers that died on it may have sent any number of its records.
            frame = end_wherever_frame(request.request_id, self.worker_id)
            await self.nc.publish(subjects.frames(request.detok_id), frame)
