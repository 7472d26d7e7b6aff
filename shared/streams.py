"""The mesh's JetStream streams and shared durable consumers, declared by the one who holds the admin credentials.

`specmesh up` and `specmesh nats` declare them as soon as their embedded server listens; `specmesh streams` does it
for a server of one's own (Kubernetes runs it as the Job in k8s/base/nats/streams-job.yaml). Services never create
or change them: their NATS users may only look them up (shared/nats_roles.py), so that a stolen service credential
cannot seal the work queue, shrink its limits or re-filter the workers' consumer, changes that would outlive every
restart. A service waits at start until what it uses exists (`wait_for`).

Declaring is idempotent and authoritative: an existing stream takes the limits given (shared/stream_limits.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import nats
import nats.errors
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError, NotFoundError, ServiceUnavailableError

from shared import subjects
from shared.nats_settings import NatsSettings
from shared.natsutil import PERMISSIONS_VIOLATION, request_consumer_config
from shared.stream_limits import StreamLimits

log = logging.getLogger(__name__)
T = TypeVar("T")

STREAM_NAME_IN_USE = 10058  # JetStream API error code: a stream of this name exists with another configuration
RESPONSE_EVENTS_MAX_AGE_S = 24 * 3600.0
MAX_DEAD_LETTERS = 10_000  # advisories and requests kept for operators to look at; the oldest go first
DEAD_LETTER_MAX_AGE_S = 7 * 24 * 3600.0
DEAD_LETTER_HANDLING_ACK_WAIT_S = 30.0  # a worker that dies while moving a request leaves its advisory to another
MAX_DEAD_LETTER_HANDLINGS = 5  # an advisory whose handling keeps failing is given up on too
WAIT_POLL_S = 0.5
WAIT_WARN_EVERY_S = 10.0
CONNECT_RETRY_S = 0.5
CONNECT_TIMEOUT_S = 2.0
# An admin's API call takes milliseconds; one a user may not make is refused by the server and never answered, so
# this is how long a refusal takes to show.
API_TIMEOUT_S = 2.0
DEFAULT_DECLARE_TIMEOUT_S = 120.0  # `specmesh streams` may start before its server (a Kubernetes Job beside it)
# A server still starting: nothing listens yet, or JetStream does not answer its API yet.
NOT_UP_YET = (OSError, nats.errors.NoServersError, nats.errors.NoRespondersError, ServiceUnavailableError)
HOW_TO_DECLARE = (
    "`specmesh up` and `specmesh nats` declare them at start; for a NATS server of your own run `specmesh streams` "
    "with the admin user's credentials (the Kubernetes Job specmesh-streams)"
)


@dataclass(frozen=True)
class Needed:
    """A stream a service uses, and the shared durable consumer of it it binds to, if any."""

    stream: str
    consumer: str | None = None

    def __str__(self) -> str:
        return self.stream if self.consumer is None else f"{self.stream} (consumer {self.consumer})"


GATEWAY_NEEDS = (
    Needed(subjects.REQUEST_STREAM), Needed(subjects.ROUTED_STREAM), Needed(subjects.RESPONSE_STREAM),
    Needed(subjects.RESPONSE_EVENTS_STREAM),
)
WORKER_NEEDS = (
    Needed(subjects.REQUEST_STREAM, subjects.WORKER_CONSUMER),
    Needed(subjects.ROUTED_STREAM),
    Needed(subjects.DEAD_LETTER_STREAM, subjects.DEAD_LETTER_CONSUMER),
)


def _work_queue(name: str, stream_subjects: list[str], limits: StreamLimits) -> StreamConfig:
    return StreamConfig(
        name=name, subjects=stream_subjects, retention=RetentionPolicy.WORK_QUEUE, storage=StorageType.FILE,
        **limits.stream_options(),
    )


def _dead_letters() -> StreamConfig:
    return StreamConfig(
        name=subjects.DEAD_LETTER_STREAM, subjects=[subjects.MAX_DELIVERIES_ADVISORY, subjects.DEAD_REQUESTS],
        retention=RetentionPolicy.LIMITS, storage=StorageType.FILE, max_msgs=MAX_DEAD_LETTERS,
        max_age=DEAD_LETTER_MAX_AGE_S, discard=DiscardPolicy.OLD,
    )


def _dead_letter_consumer() -> ConsumerConfig:
    return ConsumerConfig(
        durable_name=subjects.DEAD_LETTER_CONSUMER, filter_subject=subjects.MAX_DELIVERIES_ADVISORY,
        ack_policy=AckPolicy.EXPLICIT, ack_wait=DEAD_LETTER_HANDLING_ACK_WAIT_S, max_deliver=MAX_DEAD_LETTER_HANDLINGS,
    )


def _response_store(limits: StreamLimits) -> StreamConfig:
    """The stored responses' key-value bucket, as JetStream lays one out (one entry per key, direct gets, deletes as
    markers), except that a full store drops its oldest responses rather than refusing new ones."""
    return StreamConfig(
        name=subjects.RESPONSE_STREAM, subjects=[subjects.RESPONSE_KEYS], retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE, max_msgs_per_subject=1, max_age=limits.response_store_max_age_s,
        max_bytes=limits.response_store_max_bytes, discard=DiscardPolicy.OLD, allow_direct=True,
        allow_rollup_hdrs=True, deny_delete=True,
    )


def _response_events(limits: StreamLimits) -> StreamConfig:
    """Background responses' streaming events (services/gateway/responses/event_log.py), for picking a dropped stream
    up again: kept a day (or as long as the responses, if less), within as many bytes as the responses, the oldest
    dropped first (a response's events take tens of times its entry's bytes); read back by direct gets."""
    return StreamConfig(
        name=subjects.RESPONSE_EVENTS_STREAM, subjects=[subjects.response_events("*")],
        retention=RetentionPolicy.LIMITS, storage=StorageType.FILE,
        max_age=min(limits.response_store_max_age_s, RESPONSE_EVENTS_MAX_AGE_S),
        max_bytes=limits.response_store_max_bytes, discard=DiscardPolicy.OLD, allow_direct=True,
    )


async def _create_or_update(js: JetStreamContext, config: StreamConfig) -> None:
    try:
        await js.add_stream(config)
    except BadRequestError as exc:
        if exc.err_code != STREAM_NAME_IN_USE:
            raise
        await js.update_stream(config)


async def declare_streams(js: JetStreamContext, limits: StreamLimits = StreamLimits()) -> None:
    """Creates the request, routed and dead-letter streams and their shared consumers, the response store and the
    background responses' event log, or brings existing ones to this configuration. Needs the admin user."""
    await _create_or_update(js, _work_queue(subjects.REQUEST_STREAM, list(subjects.REQUEST_SUBJECTS), limits))
    await js.add_consumer(subjects.REQUEST_STREAM, request_consumer_config(subjects.WORKER_CONSUMER))
    await _create_or_update(js, _work_queue(subjects.ROUTED_STREAM, [subjects.ROUTED_SUBJECTS], limits))
    await _create_or_update(js, _dead_letters())
    await js.add_consumer(subjects.DEAD_LETTER_STREAM, _dead_letter_consumer())
    await _create_or_update(js, _response_store(limits))
    await _create_or_update(js, _response_events(limits))


async def _missing(js: JetStreamContext, needs: tuple[Needed, ...]) -> list[Needed]:
    missing = []
    for need in needs:
        try:
            if need.consumer is None:
                await js.stream_info(need.stream)
            else:
                await js.consumer_info(need.stream, need.consumer)
        except NotFoundError:
            missing.append(need)
    return missing


async def wait_for(js: JetStreamContext, needs: tuple[Needed, ...], service: str) -> None:
    """Returns once every stream and consumer in `needs` exists, warning now and then of what is still missing."""
    warned_at = None
    while missing := await _missing(js, needs):
        now = time.monotonic()
        if warned_at is None or now - warned_at >= WAIT_WARN_EVERY_S:
            warned_at = now
            log.warning("%s: waiting for %s to be declared: %s", service, ", ".join(map(str, missing)), HOW_TO_DECLARE)
        await asyncio.sleep(WAIT_POLL_S)


async def _ignore(exc: Exception) -> None:
    """nats-py logs every error with a traceback unless its error callback takes them."""


async def _connect_once(
    settings: NatsSettings, on_error: Callable[[Exception], Awaitable[None]] = _ignore
) -> nats.NATS:
    """One connection for one job (a declaration, a purge): a single attempt, no reconnects; what goes wrong is
    raised to the caller, errors reported on the way go to `on_error`."""
    return await nats.connect(
        settings.url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=CONNECT_TIMEOUT_S,
        error_cb=on_error, **settings.connect_options(),
    )


async def declare(settings: NatsSettings, limits: StreamLimits, timeout_s: float = DEFAULT_DECLARE_TIMEOUT_S) -> None:
    """Connects as `settings` say and declares, retrying while the server or its JetStream is not up yet, for up
    to `timeout_s`. A refusal is raised with the first answer: wrong credentials (nats.errors.Error), or a user
    without the admin's permissions (PermissionError; the server refuses its API calls, which then time out)."""
    deadline = time.monotonic() + timeout_s
    while True:
        refused: list[Exception] = []

        async def on_error(exc: Exception) -> None:
            if PERMISSIONS_VIOLATION in str(exc).lower():
                refused.append(exc)

        try:
            nc = await _connect_once(settings, on_error)
            try:
                await declare_streams(nc.jetstream(timeout=API_TIMEOUT_S), limits)
                return
            finally:
                await nc.close()
        except NOT_UP_YET as exc:
            if refused:
                raise PermissionError(
                    f"the NATS user {settings.credentials.user if settings.credentials else '(none)'} may not "
                    f"declare the streams: {refused[0]}"
                ) from exc
            if time.monotonic() >= deadline:
                raise TimeoutError(f"NATS at {settings.url} did not take the streams within {timeout_s:g}s: {exc!r}")
            await asyncio.sleep(CONNECT_RETRY_S)


async def drop_orphaned_requests(settings: NatsSettings) -> int:
    """Empties the request and routed streams; returns how many requests they held. For `specmesh up` starting its
    own server: every request stored by an earlier run (one killed without a chance to stop its requests) lost its
    client with that run's gateway, and would only be retried until it is dead-lettered."""
    nc = await _connect_once(settings)
    try:
        js, dropped = nc.jetstream(), 0
        for stream in (subjects.REQUEST_STREAM, subjects.ROUTED_STREAM):
            dropped += (await js.stream_info(stream)).state.messages
            await js.purge_stream(stream)
        return dropped
    finally:
        await nc.close()


class OnThread(Generic[T]):
    """A coroutine on an event loop of its own thread, so that synchronous code (a launcher; a test inside its own
    event loop) can wait for it (`result`) or go on meanwhile (`future`)."""

    def __init__(self, coroutine: Coroutine[Any, Any, T]) -> None:
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._run, name="streams", daemon=True).start()
        self.future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        self.future.add_done_callback(lambda _: self._loop.call_soon_threadsafe(self._loop.stop))

    def _run(self) -> None:
        self._loop.run_forever()
        self._loop.close()

    def result(self) -> T:
        """Waits for the coroutine; returns what it returned, raises what it raised."""
        return self.future.result()


def declare_blocking(
    settings: NatsSettings, limits: StreamLimits, timeout_s: float = DEFAULT_DECLARE_TIMEOUT_S
) -> None:
    """`declare` from synchronous code."""
    OnThread(declare(settings, limits, timeout_s)).result()
