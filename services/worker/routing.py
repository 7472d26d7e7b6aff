"""A worker's side of prefix-aware routing (the gateway's is services/gateway/prefix_router.py).

- It says what it holds: the names of the blocks its prefix cache stores and evicts go out as cache events after
  the steps that changed them (shared/cache_events.py), and its state every WORKER_STATE_PERIOD_S (schemas.
  WorkerState: alive, how busy, the revision and block size its names are made of, draining). It keeps the names it
  announced, to send them all again to a gateway that asks (a snapshot, in events of at most SNAPSHOT_NAMES).
- It takes the requests gateways route to it from its own consumer of the routed stream (shared/subjects.py), beside
  the shared queue, under the same capacity. A routed message delivered a second time may have started here before
  a crash: it is never run from here but moved to the shared queue, marked as delivered before, where the take-over
  path asks its detokenizer where its output stands, and where redelivery limits and dead letters apply.
- It adopts the routed subjects of workers that are gone: every SWEEP_PERIOD_S it counts the routed stream's messages
  per subject, and moves to the shared queue those of a worker whose state stopped coming DEAD_AFTER_S ago or that
  is draining (its messages in flight stay ack-pending while it heartbeats them, so only untaken ones move). The
  durable consumer of a worker gone GONE_AFTER_S with nothing left is deleted.
- Draining, it stops taking routed requests, says so, and moves its routed backlog to the shared queue.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

import nats.errors
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from pydantic import ValidationError

from shared import subjects
from shared.cache_events import CacheEvents
from shared.config import EngineConfig
from shared.natsutil import REQUEST_ACK_WAIT_S, core_only, ensure_routed_consumer, routed_consumer
from shared.schemas import WorkerState
from services.worker.metrics import BAD_WORKER_STATES, ROUTED_MOVED, WorkerMetrics
from services.worker.takeover import delivery_id

log = logging.getLogger("specmesh.worker")

WORKER_STATE_PERIOD_S = 0.5
# Silence after which a worker's routed requests are adopted: as long as JetStream waits for a request's heartbeat,
# which the same event loop sends, so that a worker loses its routed requests when it loses its shared ones.
DEAD_AFTER_S = REQUEST_ACK_WAIT_S
# Silence after which a worker's empty routed consumer is deleted: far longer, so that a NATS outage, after which
# every peer's state is old until it comes again, deletes no live worker's consumer (each also declares its own again
# every sweep).
GONE_AFTER_S = 60.0
SWEEP_PERIOD_S = 0.5
SNAPSHOT_NAMES = 16384  # names per snapshot event: 256 KiB, well inside NATS's max_payload
MOVE_BATCH = 64
MOVE_FETCH_TIMEOUT_S = 0.2


def routed_owner(subject: str) -> int | None:
    """The worker a routed subject belongs to, or None for another subject."""
    prefix = subjects.routed("")
    if not subject.startswith(prefix) or not subject[len(prefix):].isdigit():
        return None
    return int(subject[len(prefix):])


class Routing:
    def __init__(
        self, nc, worker_id: int, config: EngineConfig, revision: str, in_flight, held_routed,
        metrics: WorkerMetrics,
    ) -> None:
        """in_flight: a callable giving the sequences the worker holds (QueueWorker.num_choices); held_routed: the
        routed messages among them (they stay in the stream until acknowledged, and are not a backlog)."""
        self.nc = nc
        self.js = nc.jetstream()
        self.worker_id = worker_id
        self.epoch = secrets.randbits(63)
        self.metrics = metrics
        self.draining = False
        # The engine hangs (QueueWorker.stalled): said as draining, so that gateways stop routing here and peers
        # adopt the routed requests, which only this worker's own consumer would take again.
        self.stalled = False
        self._config = config
        self._revision = revision
        self._in_flight = in_flight
        self._held_routed = held_routed
        self._events_sent = 0
        self._names: set[bytes] = set()  # the block names its cache holds, as announced
        self._backlog = 0  # routed requests waiting in this worker's own queue, as last counted
        self._last_seen: dict[int, tuple[float, bool]] = {}  # other workers: (when their state came, draining)
        self._consumers_seen: dict[str, float] = {}  # other workers' routed consumers: when this worker first saw each
        self._started = time.monotonic()

    async def start(self):
        """Declares this worker's consumer of the routed stream, listens to the others' states; returns the pull
        subscription of its own routed requests."""
        await ensure_routed_consumer(self.js, self.worker_id)
        await self.nc.subscribe(subjects.worker_state("*"), cb=core_only(self._on_state))
        await self.nc.subscribe(subjects.cache_sync(self.worker_id), cb=core_only(self._on_sync))
        return await self.js.pull_subscribe_bind(routed_consumer(self.worker_id), subjects.ROUTED_STREAM)

    def state(self) -> WorkerState:
        return WorkerState(
            worker_id=self.worker_id, epoch=self.epoch, revision=self._revision,
            block_size=self._config.block_size, caching=self._config.enable_prefix_caching,
            max_num_seqs=self._config.max_num_seqs, in_flight=self._in_flight(), routed_backlog=self._backlog,
            draining=self.draining or self.stalled, role=self._config.role,
        )

    async def publish_state(self) -> None:
        await self.nc.publish(subjects.worker_state(self.worker_id), self.state().to_bytes())

    async def state_loop(self) -> None:
        while True:
            try:
                await self.publish_state()
            except nats.errors.Error as exc:
                log.debug("no state sent: %r", exc)
            await asyncio.sleep(WORKER_STATE_PERIOD_S)

    async def publish_events(self, stored: list[bytes], removed: list[bytes]) -> None:
        """One step's cache events, if it changed the cache."""
        if not (stored or removed):
            return
        self._names.difference_update(removed)
        self._names.update(stored)
        await self._publish(tuple(stored), tuple(removed))

    async def _publish(self, stored: tuple[bytes, ...], removed: tuple[bytes, ...], snapshot: bool = False) -> None:
        events = CacheEvents(self.worker_id, self.epoch, self._events_sent, stored, removed, snapshot)
        self._events_sent += 1
        await self.nc.publish(subjects.cache_events(self.worker_id), events.encode())

    async def _on_sync(self, msg: Msg) -> None:
        """A gateway asks for every name this worker holds: a snapshot, the first event flagged."""
        names = sorted(self._names)
        try:
            for start in range(0, max(len(names), 1), SNAPSHOT_NAMES):
                await self._publish(tuple(names[start : start + SNAPSHOT_NAMES]), (), snapshot=start == 0)
        except nats.errors.Error as exc:
            log.warning("no cache snapshot sent: %r", exc)

    async def _on_state(self, msg: Msg) -> None:
        try:
            state = WorkerState.from_bytes(msg.data)
        except (ValidationError, ValueError) as exc:
            log.warning("ignoring a malformed worker state: %s", exc)
            self.metrics.child(BAD_WORKER_STATES).inc()
            return
        if state.worker_id != self.worker_id:
            self._last_seen[state.worker_id] = (time.monotonic(), state.draining)

    def is_routed(self, msg: Msg) -> bool:
        return routed_owner(msg.subject) is not None

    async def move(self, msg: Msg) -> None:
        """Moves a routed message to the shared queue, marked when it was delivered before; then acknowledges it."""
        delivered_before = msg.metadata.num_delivered > 1
        # Stored once however often it is moved: a mover that dies, or is cancelled by its drain, between this
        # publish and the ack leaves the routed message to be moved again, and two copies would both run.
        headers = {subjects.DELIVERY_HEADER: delivery_id(msg),
                   subjects.MSG_ID_HEADER: f"moved:{msg.metadata.stream}:{msg.metadata.sequence.stream}"}
        if delivered_before:
            headers[subjects.DELIVERED_BEFORE_HEADER] = "1"
        await self.js.publish(subjects.RESUMED_REQUESTS, msg.data, headers=headers)
        await msg.ack()
        self.metrics.child(ROUTED_MOVED, delivered_before=str(delivered_before).lower()).inc()

    async def move_backlog(self) -> int:
        """Moves what waits in this worker's own routed queue to the shared queue (draining); returns how many."""
        return await self._move_all(self.worker_id)

    async def sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_PERIOD_S)
            try:
                await self._sweep()
            except nats.errors.Error as exc:
                log.warning("routed requests not swept: %r", exc)

    async def _sweep(self) -> None:
        info = await self.js.stream_info(subjects.ROUTED_STREAM, subjects_filter=subjects.ROUTED_SUBJECTS)
        counts = {routed_owner(subject): count for subject, count in (info.state.subjects or {}).items()}
        self._backlog = max(0, counts.get(self.worker_id, 0) - self._held_routed())
        await ensure_routed_consumer(self.js, self.worker_id)  # in case a peer deleted it (see GONE_AFTER_S)
        if time.monotonic() - self._started < DEAD_AFTER_S:
            return  # too young to tell a silent worker from one not heard yet
        for owner, count in counts.items():
            if owner is not None and owner != self.worker_id and count and not self._alive(owner):
                # A draining worker's own messages may all be taken (delivered, not yet settled): nothing to say.
                if moved := await self._move_all(owner):
                    log.info("adopted %d routed requests of worker %d", moved, owner)
        await self._delete_gone_consumers()

    def _alive(self, owner: int) -> bool:
        seen, draining = self._last_seen.get(owner, (-float("inf"), False))
        return not draining and time.monotonic() - seen < DEAD_AFTER_S

    async def _move_all(self, owner: int) -> int:
        await ensure_routed_consumer(self.js, owner)  # a gateway may have routed to it before it declared one
        psub = await self.js.pull_subscribe_bind(routed_consumer(owner), subjects.ROUTED_STREAM)
        moved = 0
        try:
            while True:
                try:
                    msgs = await psub.fetch(batch=MOVE_BATCH, timeout=MOVE_FETCH_TIMEOUT_S)
                except (NatsTimeoutError, asyncio.TimeoutError):
                    return moved
                for msg in msgs:
                    await self.move(msg)
                moved += len(msgs)
        finally:
            await psub.unsubscribe()

    async def _delete_gone_consumers(self) -> None:
        """Deletes the routed consumers of workers silent for GONE_AFTER_S with nothing left in them, timing a
        consumer first seen now from now, so that a worker just started is heard before it could be judged."""
        now = time.monotonic()
        for info in await self.js.consumers_info(subjects.ROUTED_STREAM):
            owner = routed_owner(info.config.filter_subject or "")
            if owner is None or owner == self.worker_id:
                continue
            first_seen = self._consumers_seen.setdefault(info.name, now)
            seen, _ = self._last_seen.get(owner, (first_seen, False))
            silent = now - max(seen, first_seen) >= GONE_AFTER_S
            if silent and not info.num_pending and not info.num_ack_pending:
                await self.js.delete_consumer(subjects.ROUTED_STREAM, info.name)
                self._consumers_seen.pop(info.name, None)
                self._last_seen.pop(owner, None)
