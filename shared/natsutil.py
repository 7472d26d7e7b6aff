"""Connecting to NATS the same way in every service, and the durable consumers of requests."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import SlowConsumerError
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig
from prometheus_client import Counter

from shared import subjects
from shared.nats_settings import NatsSettings
from shared.observability import NatsMetrics

log = logging.getLogger(__name__)

MAX_PENDING_BYTES = 64 * 1024 * 1024  # per subscription; past it nats-py drops messages and reports SlowConsumer
PERMISSIONS_VIOLATION = "permissions violation"  # nats-server's -ERR for a refused publish or subscription, any case
# How long a work-queue message stays with a worker that has gone silent: a dead worker's requests go to another worker
# this long after its last heartbeat (in_progress, every REQUEST_HEARTBEAT_S; the heartbeat runs on the worker's event
# loop, apart from the engine process, so a long step does not hold it up). An existing consumer takes it at start-up.
REQUEST_ACK_WAIT_S = 2.5
REQUEST_HEARTBEAT_S = REQUEST_ACK_WAIT_S / 5  # four heartbeats may go astray before a live worker loses a request
# Deliveries of one work-queue message before JetStream gives up on it (services/worker/dead_letters.py). A worker
# terminates what it refuses or fails, so only deaths and stalls redeliver. The detokenizer's --max-migrations (3)
# usually ends a request that keeps losing its worker first; this bounds the rest, e.g. a message retried because its
# detokenizer did not answer, or one every worker dies on before asking.
REQUEST_MAX_DELIVER = 5
JETSTREAM_DELIVERY = "$JS.ACK."  # how the reply subject of every message a JetStream consumer delivers begins
MAX_REFUSALS_LOGGED = 16
_REFUSED_ON: set[str] = set()
DELIVERIES_REFUSED = Counter(
    "specmesh_nats_jetstream_deliveries_refused",
    "Messages a JetStream consumer delivered on a subject only services publish to, dropped (a consumer made to forge)",
)


class NatsErrors:
    """Counts what nats-py reports through its callbacks, as the service's NATS metrics."""

    def __init__(self, service: str, on_reconnect: Callable[[], None] | None = None) -> None:
        self.service = service
        self.metrics = NatsMetrics.for_service(service)
        self._on_reconnect = on_reconnect

    async def on_error(self, exc: Exception) -> None:
        if isinstance(exc, SlowConsumerError):
            self.metrics.slow_consumers.inc()
            log.warning("%s: slow consumer on %s, messages dropped", self.service, exc.subject)
        elif PERMISSIONS_VIOLATION in str(exc).lower():
            # The server dropped a publish or refused a subscription: this role's permissions (shared/nats_roles.py)
            # do not cover a subject the service uses.
            self.metrics.permission_violations.inc()
            log.error("%s: %s", self.service, exc)
        else:
            self.metrics.errors.inc()
            log.warning("%s: NATS error: %s", self.service, exc)

    async def on_reconnect(self) -> None:
        self.metrics.reconnects.inc()
        log.info("%s: reconnected to NATS", self.service)
        if self._on_reconnect is not None:
            self._on_reconnect()

    async def on_disconnect(self) -> None:
        log.warning("%s: disconnected from NATS", self.service)


async def connect(settings: NatsSettings, service: str, on_reconnect: Callable[[], None] | None = None) -> Client:
    """Connects as the settings' role and keeps reconnecting for as long as the service lives; counts what goes
    wrong. `on_reconnect` is called after each reconnect: core NATS messages may have been lost meanwhile."""
    errors = NatsErrors(service, on_reconnect)
    nc = await nats.connect(
        settings.url,
        name=f"specmesh-{service}",
        **settings.connect_options(),
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        error_cb=errors.on_error,
        reconnected_cb=errors.on_reconnect,
        disconnected_cb=errors.on_disconnect,
    )
    errors.metrics.watch(nc)
    return nc


async def barrier(nc: Client) -> None:
    """Returns once the server has processed every command this connection sent before the call: a subscription
    made, after which another connection may publish to it, or a publish made.

    nats-py's flush() is not that: it writes its PING straight to the socket, ahead of commands still waiting in the
    client's buffer for its flusher task (a SUB just made), so its PONG can come back before the server has read
    them, and a request from another connection then finds no responders. Waiting on the first PONG lets the flusher
    run (it was woken before any reply can be read); the second PING follows everything it wrote.

    A caller cancelled meanwhile returns at once, but the flushes run to their PONGs on a task of their own: nats-py
    leaves a cancelled flush's future among those its PONGs resolve, and resolving it raises in the connection's read
    loop, which then stops reading (every later request on the connection times out)."""
    flushing = asyncio.ensure_future(_flush_twice(nc))
    # Left running by a cancelled caller, it may end in a flush timeout (a connection closed first) nobody awaits
    flushing.add_done_callback(lambda done: done.cancelled() or done.exception())
    await asyncio.shield(flushing)


async def _flush_twice(nc: Client) -> None:
    await nc.flush()
    await nc.flush()


def core_only(handler: Callable[[Msg], Awaitable[None]]) -> Callable[[Msg], Awaitable[None]]:
    """A core subscription's handler that drops what a JetStream consumer delivers. A push consumer delivers its
    stream's messages on whatever subject its creator names, past the creator's own publish permissions: a worker's
    user may create consumers of the routed stream (services/worker/routing.py), and one could deliver a message it
    stored there as a chunk to a gateway, or as a cancel. What services publish on these subjects never carries a
    JetStream reply subject."""

    async def handle(msg: Msg) -> None:
        if msg.reply.startswith(JETSTREAM_DELIVERY):
            DELIVERIES_REFUSED.inc()
            if msg.subject not in _REFUSED_ON and len(_REFUSED_ON) < MAX_REFUSALS_LOGGED:  # each subject once
                _REFUSED_ON.add(msg.subject)
                log.error("dropped a JetStream delivery on %s (reply %s): a consumer made to forge delivers there "
                          "(counted in specmesh_nats_jetstream_deliveries_refused)", msg.subject, msg.reply)
            return
        await handler(msg)

    return handle


def request_consumer_config(durable_name: str, filter_subject: str | None = None) -> ConsumerConfig:
    """A durable pull consumer of requests: explicit acks, redelivered after REQUEST_ACK_WAIT_S of silence."""
    return ConsumerConfig(
        durable_name=durable_name, filter_subject=filter_subject, ack_policy=AckPolicy.EXPLICIT,
        ack_wait=REQUEST_ACK_WAIT_S, max_ack_pending=-1, max_deliver=REQUEST_MAX_DELIVER,
    )


def routed_consumer(worker_id: int) -> str:
    """The durable pull consumer of a worker's routed subject (a consumer name, not a subject)."""
    return f"worker-{worker_id}"


async def ensure_routed_consumer(js: JetStreamContext, worker_id: int) -> None:
    """Declares a worker's durable consumer of its routed subject (idempotent: an adopter declares it again)."""
    await js.add_consumer(
        subjects.ROUTED_STREAM, request_consumer_config(routed_consumer(worker_id), subjects.routed(worker_id))
    )
