"""A prefill worker's side of a handoff: choose a decode worker, send it the KV, then the request.

The decode worker is chosen as gateways choose workers (shared/prefix_router.py): the one holding the longest part of
the prompt, unless it is much busier than the least busy. Only the blocks it does not hold travel (format.trim).
The request goes to its routed subject only once the KV arrived, with the transfer's id (schemas.HandoffTicket), and
the prefill worker acknowledges its own message only once JetStream stored that one: a prefill worker that dies
before leaves its request to be taken over (the detokenizer tells the next one where its output stands); one that
dies after has nothing left to lose.

While no decode worker takes it (none known, all busy), the request waits here, its message heartbeated and its bytes
held (the lease), and is offered again every RETRY_S. A transfer that fails at a live decode worker (a bad chunk, a
timeout) is not retried: the request goes there without its KV, to be recomputed, and is counted.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable

import nats.errors
from nats.aio.client import Client

from shared import subjects
from shared.prefix_router import PrefixRouter
from shared.schemas import HandoffTicket, WorkRequest
from services.worker.handoff.format import trim
from services.worker.handoff.transport import KvTransport, TransferFailed
from services.worker.metrics import HANDOFF_BYTES, HANDOFF_FAILURES, HANDOFF_SECONDS, HANDOFFS, WorkerMetrics

log = logging.getLogger("specmesh.worker")

RETRY_S = 0.25  # how soon a request no decode worker took is offered again
PUBLISH_ATTEMPTS = 3  # a handed request's publish to its decode worker, before another is tried


class HandoffSender:
    def __init__(
        self, nc: Client, worker_id: int, transport: KvTransport, router: PrefixRouter, metrics: WorkerMetrics
    ) -> None:
        self.nc = nc
        self.worker_id = worker_id
        self.transport = transport
        self.router = router
        self.metrics = metrics

    async def hand_off(
        self, request: WorkRequest, payload: bytes, cancelled: Callable[[], bool], superseded: str
    ) -> bool:
        """Hands `request` (with its progress and seed) to a decode worker; True once one holds it, False when it was
        cancelled meanwhile. `superseded`: the delivery this worker held, which the handoff replaces."""
        started = time.perf_counter()
        js = self.nc.jetstream()
        tried: set[int] = set()
        while not cancelled():
            placement = self.router.place(
                list(request.prompt_token_ids), request.cache_salt, request.num_choices, frozenset(tried)
            )
            if placement is None:
                tried.clear()  # every decode worker was tried, or none is known yet: again, after a while
                await asyncio.sleep(RETRY_S)
                continue
            worker_id = placement.worker_id
            transfer_id = uuid.uuid4().hex
            data = trim(payload, placement.depth) if placement.depth else payload
            kv_sent = True
            try:
                await self.transport.send(worker_id, transfer_id, data)
            except TransferFailed as exc:
                reason = "gone" if exc.gone else "busy" if exc.busy else "failed"
                self.metrics.child(HANDOFF_FAILURES, reason=reason).inc()
                if exc.gone or exc.busy:
                    log.info("request %s not handed to worker %d: %s", request.request_id, worker_id, exc)
                    tried.add(worker_id)
                    continue
                # The ticket still names the transfer: the decode worker drops what arrived of it, or imports it
                # if it did arrive whole after all.
                log.warning("request %s goes to worker %d without its KV: %s", request.request_id, worker_id, exc)
                kv_sent = False
            handed = request.model_copy(
                update={"handoff": HandoffTicket(
                    transfer_id=transfer_id, from_worker=self.worker_id, superseded=superseded
                )}
            )
            if not await self._publish(js, worker_id, handed, transfer_id):
                tried.add(worker_id)
                continue
            self.metrics.child(HANDOFFS, outcome="sent" if kv_sent else "sent_without_kv").inc()
            if kv_sent:
                self.metrics.child(HANDOFF_BYTES).inc(len(data))
            self.metrics.child(HANDOFF_SECONDS).observe(time.perf_counter() - started)
            return True
        return False

    async def _publish(self, js, worker_id: int, handed: WorkRequest, transfer_id: str) -> bool:
        """Queues the handed request for its decode worker; False when JetStream did not say it stored it. Sent
        again under the same message id, a copy stored already is not stored twice: the request, and the KV that
        came for it, stay with the worker they were sent to."""
        headers = {subjects.MSG_ID_HEADER: f"handoff:{transfer_id}"}
        for attempt in range(1, PUBLISH_ATTEMPTS + 1):
            try:
                await js.publish(subjects.routed(worker_id), handed.to_bytes(), headers=headers)
                return True
            except nats.errors.Error as exc:
                log.warning("request %s not queued for worker %d (attempt %d of %d): %r", handed.request_id,
                            worker_id, attempt, PUBLISH_ATTEMPTS, exc)
        return False
