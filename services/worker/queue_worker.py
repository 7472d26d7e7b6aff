"""Feeds the engine process from the JetStream work queue and publishes what it produces.

The engine runs in a process of its own (engine_process.py), step after step, and never waits for NATS: each
step's frames, the acks of the requests it finished and its metrics come back to this event loop, which sends them
while the next step computes. One coroutine sends the results in step order, so a request's frames go out in step
order (DRAFT before TARGET within a step), and a request's ack follows its finishing frame on the same connection.
New requests and cancels go to the engine as they come; it applies them between steps (step_runner.py).

A request's message is acknowledged only when the request is finished; until then the worker tells JetStream
it is still in progress, so a request held by a crashed worker is redelivered rather than lost. A worker
that drains hands its unfinished requests back to the queue with their progress (`hand_back`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict

import nats.errors
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from pydantic import ValidationError

from shared import subjects
from shared.frames import frame_kind
from shared.natsutil import REQUEST_ACK_WAIT_S, REQUEST_HEARTBEAT_S
from shared.schemas import Cancel, ChoiceProgress, HandoffTicket, RequestAddress, WorkRequest
from services.worker.engine_process import EngineProcess
from services.worker.engine_protocol import StepResult, Work
from services.worker.fail_reason import FailReason
from services.worker.handoff.sender import HandoffSender
from services.worker.handoff.transport import KvTransport
from services.worker.metrics import (
    ENGINE_STALLS, FAILED_REQUESTS, HANDOFFS, PREEMPTIONS, REQUESTS_HANDED_BACK, REQUESTS_RELEASED, TAKE_OVERS,
    WorkerMetrics,
)
from services.worker.hand_back import resumed_request
from services.worker.publisher import end_wherever_frame
from services.worker.routing import Routing
from services.worker.takeover import RETRY_DELAY_S, Outcome, came_back, delivery_id, take_over

log = logging.getLogger("specmesh.worker")

FETCH_TIMEOUT_S = 0.5  # how long an idle worker waits on the queue before looking again
RECENT_CANCELS = 4096  # cancellations remembered for requests that have not arrived yet
CAPACITY_POLL_S = 0.01  # how often a full worker looks again for room to fetch
# An engine holding requests that returns no step for this long is taken to hang: a step is at most
# max_num_batched_tokens rows, milliseconds to seconds, but on a GPU the first steps of each shape also compile
# their Triton kernels (seconds each).
ENGINE_STALL_S = 120.0
# A worker loses a request only after ack_wait without its heartbeats: a release that comes sooner after this worker
# took the request over concerns an earlier run (it crossed the take-over's answer on the way), and is ignored. The
# detokenizer repeats a release while the loser's records keep coming, so a real one comes again later.
RELEASE_GRACE_S = REQUEST_ACK_WAIT_S / 2


class QueueWorker:
    def __init__(
        self, engine: EngineProcess, nc, worker_id: int, metrics: WorkerMetrics, stall_after_s: float = ENGINE_STALL_S
    ) -> None:
        self.engine = engine
        self.nc = nc
        self.worker_id = worker_id
        self.metrics = metrics
        self._recent_cancels: OrderedDict[str, None] = OrderedDict()
        self._messages: dict[str, Msg] = {}  # unacknowledged work-queue messages by request id
        self._requests: dict[str, WorkRequest] = {}  # what each in-flight request asked for
        self._acked = asyncio.Event()  # set whenever requests were acknowledged
        self._taking_over: set[asyncio.Task] = set()  # requests that came back, while their detokenizer is asked
        self._asking: set[str] = set()  # the ids of those requests
        # Requests released to another worker (_let_go) whose abort the engine has not reported yet, and deliveries
        # of them that came back here meanwhile, parked (heartbeated) until it has: the engine aborts by request id
        self._released: set[str] = set()
        self._parked: dict[str, Msg] = {}
        self._lost_handoffs: set[str] = set()  # requests released while being handed off: their handoff stops
        self._taken_over_at: dict[str, float] = {}  # requests this worker took over, when (monotonic)
        self.routing: Routing | None = None  # prefix-aware routing's side here (routing.py), when it is on
        self.role = engine.config.role
        # Prefill/decode disaggregation (handoff/): a prefill worker's sender, a decode worker's receiving transport
        self.sender: HandoffSender | None = None
        self.transport: KvTransport | None = None
        self._handing_off: dict[asyncio.Task, str] = {}  # a prefill worker's handoffs in progress: their request ids
        self._stall_after_s = stall_after_s
        # When the engine last returned a step, or was last given work while it held none (stalled).
        self._last_progress = time.monotonic()
        self._stall_reported = False

    @property
    def num_choices(self) -> int:
        """Sequences of the requests taken (one per choice)."""
        return sum(request.num_choices for request in self._requests.values())

    @property
    def capacity(self) -> int:
        """Requests worth fetching now: free slots plus one batch of waiting sequences (one per choice) to keep
        steps full; none while the engine is stalled."""
        return 0 if self.stalled else 2 * self.engine.config.max_num_seqs - self.num_choices

    @property
    def stalled(self) -> bool:
        """Whether the engine, holding requests, has returned no step for stall_after_s: it hangs (a tensor-parallel
        rank that neither answers nor dies holds it in a collective for minutes). Its requests are then no longer
        heartbeated, so the work queue gives them to other workers after ack_wait, which continue their output."""
        # The clock first: the fetch loop asks every CAPACITY_POLL_S while full, and the set is built only past it.
        return time.monotonic() - self._last_progress > self._stall_after_s and bool(self._in_engine())

    def _in_engine(self) -> set[str]:
        """The requests taken that the engine holds: not those a prefill worker is handing off (it may wait long
        for a decode worker with room, with nothing to step), nor those whose detokenizer is still asked where their
        output stands (an engine idle past the stall timeout would be taken for a hung one meanwhile)."""
        return self._messages.keys() - set(self._handing_off.values()) - self._asking

    def has_room_for_handoff(self) -> bool:
        """Whether this decode worker accepts another KV transfer: room for its request beside those it runs and the
        transfers it holds, whose requests are on their way."""
        held = self.transport.num_held if self.transport is not None else 0
        return self.capacity - held > 0

    @property
    def num_in_flight(self) -> int:
        return len(self._messages)

    async def on_cancel(self, msg: Msg) -> None:
        try:
            cancel = Cancel.from_bytes(msg.data)
        except (ValidationError, ValueError) as exc:
            log.warning("ignoring malformed cancel: %s", exc)
            return
        if cancel.worker_id is not None:
            if cancel.worker_id == self.worker_id:
                self._let_go(cancel)
            return
        if cancel.choice is None:  # one choice's cancel concerns a request that has already run here
            self._recent_cancels[cancel.request_id] = None
            while len(self._recent_cancels) > RECENT_CANCELS:
                self._recent_cancels.popitem(last=False)
        self.engine.send(Work(cancels=[cancel]))

    def _let_go(self, release: Cancel) -> None:
        """Drops a request another worker took over while this one still ran it (it stalled past ack_wait): its
        message is left unsettled, since acknowledging it would take it from the work queue under the new owner.
        One being handed off is dropped from the books only (the engine exported it): its handoff then leaves the
        message unsettled too. One whose detokenizer is being asked is left alone (the release is about a run
        before)."""
        request_id = release.request_id
        taken_at = self._taken_over_at.get(request_id)
        if request_id in self._asking or taken_at is not None and time.monotonic() - taken_at < RELEASE_GRACE_S:
            return
        if self._forget(request_id) is None:
            return
        if request_id in self._handing_off.values():
            self._lost_handoffs.add(request_id)
            return
        self._released.add(request_id)
        log.warning("request %s was taken over by another worker; dropped here", request_id)
        self.metrics.child(REQUESTS_RELEASED).inc()
        self._acked.set()
        self.engine.send(Work(cancels=[release]))

    def _forget(self, request_id: str) -> Msg | None:
        """Takes a request off this worker's books; returns its message (the latest delivery), if it was held."""
        self._requests.pop(request_id, None)
        self._taken_over_at.pop(request_id, None)
        return self._messages.pop(request_id, None)

    async def fetch_loop(self, psub, routed: bool = False) -> None:
        """Takes requests from a pull subscription while there is capacity: the shared queue's, or (routed) this
        worker's own routed queue."""
        while True:
            if self.capacity <= 0:
                await asyncio.sleep(CAPACITY_POLL_S)
                continue
            try:
                # One at a time: nats-py's fetch of a batch, once its long poll has received a first message, waits
                # out the whole timeout for the rest of the batch, which would hold a request that arrives at an
                # idle worker for up to FETCH_TIMEOUT_S. A message already queued comes back in one round trip.
                msgs = await psub.fetch(batch=1, timeout=FETCH_TIMEOUT_S)
            except (NatsTimeoutError, asyncio.TimeoutError):
                msgs = []
            if asyncio.current_task().cancelling():
                # nats-py waits with asyncio.wait_for, which loses a cancellation that races an arriving message
                # (Python 3.11): the loop would go on taking requests after the drain began. What came back now
                # returns to the queue.
                for msg in msgs:
                    await msg.nak()
                raise asyncio.CancelledError
            for msg in msgs:
                await (self._take_routed(msg) if routed else self._take(msg))

    async def _take_routed(self, msg: Msg) -> None:
        """A message of this worker's own routed queue. One delivered before may have started here before a crash:
        it is moved to the shared queue, whose take-over continues it (routing.py), unless it still runs here (a
        heartbeat came too late), where _take keeps it as the shared path does."""
        if msg.metadata.num_delivered > 1 and not self._runs(msg):
            await self.routing.move(msg)
        else:
            await self._take(msg)

    def _runs(self, msg: Msg) -> bool:
        try:
            return RequestAddress.model_validate_json(msg.data).request_id in self._messages
        except ValidationError:
            return False

    @property
    def num_routed_held(self) -> int:
        """Routed messages among those taken (they stay in the routed stream until acknowledged)."""
        return sum(self.routing.is_routed(msg) for msg in self._messages.values()) if self.routing else 0

    async def _take(self, msg: Msg) -> None:
        try:
            request = WorkRequest.from_bytes(msg.data)
        except (ValidationError, ValueError) as exc:
            log.error("dropping malformed work request: %s", exc)
            self.metrics.child(FAILED_REQUESTS, reason=FailReason.MALFORMED).inc()
            await self._end_unreadable(msg.data)
            await msg.term()
            return
        if request.request_id in self._recent_cancels:
            self._let_transfer_go(request.handoff)
            await msg.ack()
        elif request.request_id in self._released:
            # Back here before the engine dropped its last run of it (it aborts by request id): taken once it has.
            self._parked[request.request_id] = msg
        elif not request.detok_id:
            log.error("dropping work request %s that names no detokenizer", request.request_id)
            self.metrics.child(FAILED_REQUESTS, reason=FailReason.NO_DETOKENIZER).inc()
            await msg.term()
        elif request.request_id in self._messages:
            # Delivered again while still running here (a heartbeat came too late): the new delivery is heartbeated.
            log.warning("request %s is already running here; keeping it", request.request_id)
            self._let_transfer_go(request.handoff)
            self._messages[request.request_id] = msg
        else:
            self.metrics.observe_request(len(request.prompt_token_ids))
            self._messages[request.request_id] = msg
            self._requests[request.request_id] = request
            if came_back(msg, request):
                # Heartbeated while its detokenizer is asked where its output stands.
                self._asking.add(request.request_id)
                task = asyncio.create_task(self._take_over(msg, request))
                self._taking_over.add(task)
                task.add_done_callback(self._taking_over.discard)
            else:
                self._start(request)

    async def _end_unreadable(self, raw: bytes) -> None:
        """Ends a message that is no valid WorkRequest at its detokenizer, when it says whose it is, so that its client
        gets an error (a gateway that disagrees with this worker's schema) rather than silence."""
        try:
            address = RequestAddress.model_validate_json(raw)
        except ValidationError:
            return
        frame = end_wherever_frame(address.request_id, self.worker_id)
        await self.nc.publish(subjects.frames(address.detok_id), frame)

    def _let_transfer_go(self, ticket: HandoffTicket | None) -> None:
        """Drops the KV that came for a handed request that will not run from it here (cancelled, over, or already
        running): held, it would count against the room for other transfers (has_room_for_handoff) until it
        expired a minute later, and the prefill workers' transfers would be refused as busy meanwhile."""
        if ticket is not None and ticket.transfer_id and self.transport is not None:
            self.transport.take(ticket.transfer_id)

    def _start(self, request: WorkRequest, handoff: bytes | None = None) -> None:
        if not self._in_engine() - {request.request_id}:
            self._last_progress = time.monotonic()  # work for an idle engine: its silence so far is no stall
        self.engine.send(Work(new=[request], handoffs={request.request_id: handoff} if handoff else {}))

    async def _take_over(self, msg: Msg, request: WorkRequest) -> None:
        """Continues a request another worker lost from where its output stands, or lets it go (takeover.py). A
        decode worker takes a request handed to it the same way, with the KV that came for it: it is imported when
        the request's output stands where the handoff says, recomputed otherwise (counted)."""
        ticket = request.handoff if self.role == "decode" else None
        handed = ticket is not None
        request = request.model_copy(update={"handoff": None})
        try:
            taken = await take_over(self.nc, request, self.worker_id, delivery_id(msg), ticket)
        finally:
            self._asking.discard(request.request_id)
        if not handed:
            self.metrics.child(TAKE_OVERS, outcome=taken.outcome).inc()
        cancelled = request.request_id in self._recent_cancels
        if taken.request is not None and not cancelled:
            payload = None
            if handed:
                # Taken once the detokenizer answered. One that did not answer lets the KV go too (below): the
                # routed message comes back delivered twice, and is moved to the shared queue, for any worker.
                kv = self.transport.take(ticket.transfer_id) if ticket.transfer_id and self.transport else None
                payload = kv if taken.request.progress == request.progress else None
                if payload is None:  # else counted as the engine admits its choices, imported or not after all
                    self.metrics.child(HANDOFFS, outcome="recomputed").inc(len(taken.request.choices()))
            else:
                log.info("request %s continues here (migration %d)", request.request_id, taken.migrations)
            self._requests[request.request_id] = taken.request
            self._taken_over_at[request.request_id] = time.monotonic()
            self._start(taken.request, payload)
            return
        self._let_transfer_go(ticket)
        self._forget(request.request_id)
        self._acked.set()
        try:
            if taken.outcome in (Outcome.NO_ANSWER, Outcome.NO_DETOKENIZER):
                await msg.nak(delay=RETRY_DELAY_S)
            elif taken.outcome is Outcome.REFUSED:
                log.warning("dropping request %s that came back: %s", request.request_id, taken.outcome)
                await msg.term()
            else:
                await msg.ack()
        except nats.errors.Error as exc:  # unanswered, the message comes back after ack_wait, to be asked about again
            log.warning("could not settle request %s (%s): %r", request.request_id, taken.outcome, exc)

    async def heartbeat_loop(self) -> None:
        """Tells JetStream every REQUEST_HEARTBEAT_S that each request taken is still being worked on. The engine
        computes in its own process, so a long step does not delay it (tests/test_heartbeat.py)."""
        while True:
            await asyncio.sleep(REQUEST_HEARTBEAT_S)
            if self.stalled:
                if not self._stall_reported:
                    log.error(
                        "the engine has returned no step for %.0f s while holding %d requests: they are no longer "
                        "heartbeated, and other workers take them over", self._stall_after_s, len(self._in_engine()),
                    )
                    self._stall_reported = True
                    self.metrics.child(ENGINE_STALLS).inc()
                    if self.routing is not None:
                        self.routing.stalled = True  # sent with the next state at the latest
                        try:
                            await self.routing.publish_state()
                        except nats.errors.Error as exc:
                            log.debug("no state sent: %r", exc)
                continue
            self._stall_reported = False
            if self.routing is not None:
                self.routing.stalled = False
            for msg in [*self._messages.values(), *self._parked.values()]:
                try:
                    await msg.in_progress()
                except nats.errors.Error as exc:  # settled meanwhile (a hand-back), or the connection closing
                    log.debug("no heartbeat for a message: %r", exc)

    def stop(self) -> None:
        """Makes publish_loop return once the step in progress, and every step before it, has been published."""
        self.engine.stop()

    async def publish_loop(self) -> None:
        """Sends each engine step's results, in step order, until the engine stopped."""
        async for result in self.engine.results():
            self._last_progress = time.monotonic()
            await self._send(result)
            self.engine.published()

    async def _send(self, result: StepResult) -> None:
        """Publishes a step's frames in order, then acknowledges the requests they finished, then counts."""
        for detok_id, frame in result.frames:
            await self.nc.publish(subjects.frames(detok_id), frame)
        for request_id in result.finished:
            if (msg := self._forget(request_id)) is not None:
                await msg.ack()
        for request_id, reason in result.failed:
            msg = self._forget(request_id)
            self.metrics.child(FAILED_REQUESTS, reason=reason).inc()
            if msg is not None:
                await msg.term()
        if result.finished or result.failed:
            self._acked.set()
        for request_id in result.released:
            self._released.discard(request_id)
            if (parked := self._parked.pop(request_id, None)) is not None:
                await self._take(parked)
        self.metrics.observe_gauges(result.gauges)
        if result.stats is not None:
            self.metrics.observe_step(result.stats, result.seconds)
        if result.num_preempted:
            self.metrics.child(PREEMPTIONS).inc(result.num_preempted)
        for _, frame in result.frames:
            self.metrics.observe_frame(frame_kind(frame).name.lower(), len(frame))
        if self.routing is not None:
            await self.routing.publish_events(result.stored, result.removed)
        if result.handoffs_recomputed:
            self.metrics.child(HANDOFFS, outcome="recomputed").inc(result.handoffs_recomputed)
        if result.handoffs_imported:
            self.metrics.child(HANDOFFS, outcome="imported").inc(result.handoffs_imported)
        for request_id, progress, seed, payload in result.handed_off:
            self._with_progress(request_id, progress, seed)  # at once: a hand-back meanwhile carries it
            task = asyncio.create_task(self._hand_off(request_id, payload))
            self._handing_off[task] = request_id
            task.add_done_callback(self._handed_off)

    def _handed_off(self, task: asyncio.Task) -> None:
        """A handoff that raised leaves its request's message unacknowledged: heartbeated no more, it comes back
        after ack_wait and its take-over continues it from where its detokenizer says."""
        request_id = self._handing_off.pop(task)
        self._lost_handoffs.discard(request_id)
        if not task.cancelled() and task.exception() is not None:
            log.error("handoff of request %s failed", request_id, exc_info=task.exception())
            self._forget(request_id)
            self._acked.set()

    def _with_progress(self, request_id: str, progress: list[tuple[int, list[int], int]], seed: int) -> None:
        """The request as its engine exported it: with each choice's progress and the seed the engine drew."""
        original = self._requests.get(request_id)
        if original is None:
            return
        self._requests[request_id] = original.model_copy(update={
            "progress": tuple(
                ChoiceProgress(index=index, output_token_ids=tuple(ids), next_seq_no=next_seq_no)
                for index, ids, next_seq_no in progress
            ),
            "sampling": original.sampling.model_copy(update={"seed": seed}),
            "handoff": None,
        })

    async def _hand_off(self, request_id: str, payload: bytes) -> None:
        """Hands a request this prefill worker exported to a decode worker (handoff/sender.py), then acknowledges its
        message; a request cancelled meanwhile is just acknowledged."""
        request, msg = self._requests.get(request_id), self._messages.get(request_id)
        if request is None or msg is None:
            return
        await self.sender.hand_off(
            request, payload, lambda: request_id in self._lost_handoffs or request_id in self._recent_cancels,
            delivery_id(msg),
        )
        if request_id in self._lost_handoffs:
            self._lost_handoffs.discard(request_id)
            return  # released meanwhile: the message is another worker's now
        msg = self._forget(request_id) or msg  # the latest delivery (one came again while it waited)
        self._acked.set()
        try:
            await msg.ack()
        except nats.errors.Error as exc:  # it comes back after ack_wait: its take-over finds it handed off
            log.warning("could not acknowledge request %s after its handoff: %r", request_id, exc)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Waits until every request taken has finished and been acknowledged; False if the timeout came first."""
        deadline = time.monotonic() + timeout_s
        while self._messages and time.monotonic() < deadline:
            self._acked.clear()
            try:
                await asyncio.wait_for(self._acked.wait(), timeout=deadline - time.monotonic())
            except TimeoutError:
                break
        return not self._messages

    async def hand_back(self) -> int:
        """Re-queues every unfinished request with its progress, so another worker continues the same output.

        Call only once publish_loop has returned. The new message carries each unfinished choice's tokens already
        sent and next record number, and the seed this worker used; the original message is acknowledged after the new one is
        stored, so the request is never lost and never doubled. Requests the engine never saw are handed back
        as they came (nak), routed ones to the shared queue.
        """
        handing_off = list(self._handing_off)
        for task in [*self._taking_over, *handing_off]:  # these go back as they stand
            task.cancel()
        await asyncio.gather(*self._taking_over, *handing_off, return_exceptions=True)
        for msg in self._parked.values():  # never started here
            await msg.nak()
        self._parked.clear()
        js = self.nc.jetstream()
        stopped = self.engine.stopped
        unseen = set(stopped.not_started)
        handed = 0
        for request_id, msg in list(self._messages.items()):
            if request_id in unseen:
                # A routed one goes to the shared queue: its own queue is read by no one once this worker is gone.
                await (self.routing.move(msg) if self.routing and self.routing.is_routed(msg) else msg.nak())
                continue
            request = self._requests[request_id]
            # One being handed off left the engine with its progress, which it carries now.
            resumed = resumed_request(request, stopped.unfinished.get(request_id)) if not request.progress else request
            # Marked as delivered before, under the delivery it continues: the next worker asks its detokenizer (a
            # take-over cut short here never reached the engine, and carries no progress), and a handoff racing this
            # hand-back is told apart from it (detokenizer/migration.py).
            headers = {subjects.DELIVERED_BEFORE_HEADER: "1", subjects.DELIVERY_HEADER: delivery_id(msg)}
            await js.publish(subjects.RESUMED_REQUESTS, resumed.to_bytes(), headers=headers)
            await msg.ack()
            handed += 1
        self.metrics.child(REQUESTS_HANDED_BACK).inc(handed)
        return handed
