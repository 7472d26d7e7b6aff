"""Feeds the engine from the JetStream work queue and publishes what it produces.

The engine runs in one dedicated thread so that NATS traffic keeps flowing while the model computes. A
request's message is acknowledged only when the request is finished; until then the worker tells JetStream
it is still in progress, so a request held by a crashed worker is redelivered rather than lost. A worker
that drains hands its unfinished requests back to the queue with their progress (`hand_back`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from pydantic import ValidationError

from shared import subjects
from shared.frames import FinishReason, FrameBuilder, FrameKind, SeqStatus, frame_kind
from shared.natsutil import REQUEST_ACK_WAIT_S
from shared.schemas import Cancel, WorkRequest
from services.worker.engine import Engine
from services.worker.metrics import PREEMPTIONS, REQUESTS_HANDED_BACK, WorkerMetrics
from services.worker.publisher import step_frames

log = logging.getLogger("specmesh.worker")
T = TypeVar("T")

FETCH_TIMEOUT_S = 0.5  # how long an idle worker waits on the queue before looking again
HEARTBEAT_S = REQUEST_ACK_WAIT_S / 3
RECENT_CANCELS = 4096  # cancellations remembered for requests that have not arrived yet


class QueueWorker:
    def __init__(self, engine: Engine, nc, worker_id: int, metrics: WorkerMetrics) -> None:
        self.engine = engine
        self.nc = nc
        self.worker_id = worker_id
        self.metrics = metrics
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._inbox: list[tuple[WorkRequest, Msg]] = []
        self._cancels: list[str] = []
        self._recent_cancels: OrderedDict[str, None] = OrderedDict()
        self._messages: dict[str, Msg] = {}  # unacknowledged work-queue messages by request id
        self._requests: dict[str, WorkRequest] = {}  # what each in-flight request asked for
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._stopping = False

    @property
    def capacity(self) -> int:
        """Requests worth fetching now: free slots plus one batch of waiting ones to keep steps full."""
        return 2 * self.engine.config.max_num_seqs - len(self._messages) - len(self._inbox)

    @property
    def num_in_flight(self) -> int:
        return len(self._messages) + len(self._inbox)

    async def on_cancel(self, msg: Msg) -> None:
        try:
            cancel = Cancel.from_bytes(msg.data)
        except (ValidationError, ValueError) as exc:
            log.warning("ignoring malformed cancel: %s", exc)
            return
        self._recent_cancels[cancel.request_id] = None
        while len(self._recent_cancels) > RECENT_CANCELS:
            self._recent_cancels.popitem(last=False)
        self._cancels.append(cancel.request_id)
        self._wake.set()

    async def fetch_loop(self, psub) -> None:
        while True:
            if self.capacity <= 0:
                await asyncio.sleep(0.01)
                continue
            try:
                msgs = await psub.fetch(batch=self.capacity, timeout=FETCH_TIMEOUT_S)
            except (NatsTimeoutError, asyncio.TimeoutError):
                continue
            for msg in msgs:
                await self._take(msg)
            self._wake.set()

    async def _take(self, msg: Msg) -> None:
        try:
            request = WorkRequest.from_bytes(msg.data)
        except (ValidationError, ValueError) as exc:
            log.error("dropping malformed work request: %s", exc)
            await msg.term()
            return
        if request.request_id in self._recent_cancels:
            await msg.ack()
        elif not request.detok_id:
            log.error("dropping work request %s that names no detokenizer", request.request_id)
            await msg.term()
        elif request.request_id in self._messages:
            log.warning("request %s is already running here; ignoring the redelivery", request.request_id)
        else:
            self.metrics.observe_request(len(request.prompt_token_ids))
            self._inbox.append((request, msg))

    async def heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            for msg in list(self._messages.values()):
                await msg.in_progress()

    def _step(self, inbox: list[WorkRequest], cancels: list[str]) -> tuple[list[tuple[str, bytes]], list[str]]:
        """Runs in the engine thread: admits, cancels and steps; returns (detokenizer id, frame) pairs and
        finished request ids."""
        refused = []
        for request in inbox:
            try:
                seq = self.engine.add_request(request)
            except ValueError as exc:
                log.warning("refusing request %s: %s", request.request_id, exc)
                refused.append(request)
                continue
            seq.target_seq_no = request.next_seq_no
        finished = [request.request_id for request in refused]
        for request_id in cancels:
            if self.engine.abort(request_id) is not None:
                finished.append(request_id)
        frames = [
            (detok_id, _abort_frame(group, self.worker_id, self.engine.step_no))
            for detok_id, group in self._by_detokenizer(refused, lambda request: request.request_id).items()
        ]
        if self.engine.has_work():
            started = time.perf_counter()
            outputs = self.engine.step()
            self.metrics.observe_step(outputs, time.perf_counter() - started)
            preempted = self._by_detokenizer(self.engine.last_preempted, lambda seq: seq.request_id)
            self.metrics.counter(PREEMPTIONS).inc(len(self.engine.last_preempted))
            groups = self._by_detokenizer(outputs, lambda out: out.seq.request_id)
            for detok_id in groups.keys() | preempted.keys():
                group, evicted = groups.get(detok_id, []), preempted.get(detok_id, [])
                frames += [(detok_id, f) for f in step_frames(group, self.worker_id, self.engine.step_no, evicted)]
            finished += [o.seq.request_id for o in outputs if o.seq.is_finished]
        return frames, finished

    def _by_detokenizer(self, items: list[T], request_id_of: Callable[[T], str]) -> dict[str, list[T]]:
        """Groups a step's items by the detokenizer that owns their request: each gets its own frames."""
        groups: dict[str, list[T]] = defaultdict(list)
        for item in items:
            groups[self._requests[request_id_of(item)].detok_id].append(item)
        return groups

    def stop(self) -> None:
        """Makes engine_loop return after the step in progress has been published."""
        self._stopping = True
        self._wake.set()

    async def engine_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping:
            if not (self._inbox or self._cancels or self.engine.has_work()):
                self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            self._idle.clear()
            inbox, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, []
            for request, msg in inbox:
                self._messages[request.request_id] = msg
                self._requests[request.request_id] = request
            frames, finished = await loop.run_in_executor(self._pool, self._step, [r for r, _ in inbox], cancels)
            for detok_id, frame in frames:
                await self.nc.publish(subjects.frames(detok_id), frame)
                self.metrics.observe_frame(frame_kind(frame).name.lower(), len(frame))
            for request_id in finished:
                self._requests.pop(request_id, None)
                msg = self._messages.pop(request_id, None)
                if msg is not None:
                    await msg.ack()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Waits until every request taken has finished; False if the timeout came first."""
        deadline = time.monotonic() + timeout_s
        while self.num_in_flight and time.monotonic() < deadline:
            try:
                await asyncio.wait_for(self._idle.wait(), timeout=max(0.01, deadline - time.monotonic()))
            except TimeoutError:
                break
            await asyncio.sleep(0.05)
        return self.num_in_flight == 0

    async def hand_back(self) -> int:
        """Re-queues every unfinished request with its progress, so another worker continues the same output.

        Call only once the engine loop has stopped. The new message carries the tokens already sent, the
        next record number and the seed this worker used; the original message is acknowledged after the
        new one is stored, so the request is never lost and never doubled.
        """
        js = self.nc.jetstream()
        pending = {s.request_id: s for s in self.engine.scheduler.running + list(self.engine.scheduler.waiting)}
        handed = 0
        for request_id, msg in list(self._messages.items()):
            original = self._requests[request_id]
            seq = pending.get(request_id)
            resumed = original if seq is None else original.model_copy(
                update={
                    "output_token_ids": tuple(seq.output_ids),
                    "next_seq_no": seq.target_seq_no,
                    "sampling": original.sampling.model_copy(update={"seed": seq.seed}),
                }
            )
            await js.publish(subjects.REQUESTS, resumed.to_bytes())
            await msg.ack()
            handed += 1
        for request, msg in self._inbox:
            await msg.nak()  # never started: the original message is the whole request
        REQUESTS_HANDED_BACK.labels(**self.metrics.labels).inc(handed)
        return handed


def _abort_frame(requests: list[WorkRequest], worker_id: int, step: int) -> bytes:
    """Refused requests finish with ABORT where their output stands (a resumed one continues its records)."""
    builder = FrameBuilder(FrameKind.TARGET, worker_id, step, top_k=0)
    for request in requests:
        builder.add_status(
            request.request_id, seq_no=request.next_seq_no, offset=len(request.output_token_ids),
            status=SeqStatus.FINISHED, finish_reason=FinishReason.ABORT,
        )
    return builder.encode()
