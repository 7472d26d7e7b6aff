"""The detokenizer's state and its NATS message handlers: frames from workers in, OpenAI-shaped chunks out.

It keeps one RequestChoices (a RequestAssembler per choice) per open request. Workers publish a step's DRAFT frame
before its TARGET frame; DRAFT records wait here until the TARGET frame of the same worker and step arrives, and are
joined to TARGET records by request id, never by position. Kept apart from service.py, which only starts the
process, subscribes these handlers and drains on shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict

import orjson
from nats.aio.client import Client
from nats.aio.msg import Msg
from pydantic import ValidationError

from services.detokenizer.assembler import Record, frame_records
from services.detokenizer.choices import RequestChoices
from services.detokenizer.incremental import TokenTable
from services.detokenizer import gateways
from services.detokenizer.metrics import (
    ABANDONED, ACTIVE, BAD_MESSAGES, CHUNKS, FRAMES_BY_KIND, LAG, MALFORMED_FRAMES, REAPED, TOKENS,
    UNKNOWN_REQUEST_FRAMES,
)
from services.detokenizer.migration import DEFAULT_MAX_MIGRATIONS, RELEASES, STALE_RECORDS, Migrations
from services.detokenizer.reaper import DEFAULT_IDLE_TIMEOUT_S, IdleRequests
from shared import subjects
from shared.frames import WHEREVER, Frame, FrameError, FrameKind, decode
from shared.schemas import Cancel, Chunk, DetokOpen, DetokReady, HeldQuery, HeldReport, ProgressQuery

log = logging.getLogger(__name__)

RECENTLY_CLOSED = 65536  # closed request ids remembered, so a worker's late frames are not taken for strays
# Frames lost while NATS was out (a restart) can leave a request waiting for a frame that never comes: after a
# reconnect, a request that hears nothing (no frame, no take-over) for this long ends with an error. Above the work
# queue's ack_wait, so that a request whose worker also died is taken over first.
RECONNECT_GRACE_S = 5.0
RELEASE_REPEAT_S = 1.0  # how often a worker that still sends records of a request it lost is told again

DraftKey = tuple[int, int]  # (worker id, step): step numbers are per worker


class Detokenizer:
    """The service's state and its message handlers."""

    def __init__(
        self, nc: Client, table: TokenTable, detok_id: str, idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
        max_migrations: int = DEFAULT_MAX_MIGRATIONS,
    ) -> None:
        self._nc = nc
        self._releases: list[Cancel] = []  # to workers sending records of requests they lost
        self._migrations = Migrations(max_migrations)
        self._unheard: set[str] = set()  # open requests that have heard nothing since the last reconnect
        self._idle = IdleRequests(idle_timeout_s)
        self.detok_id = detok_id
        self._table = table
        self._requests: dict[str, RequestChoices] = {}
        self._closed: OrderedDict[str, None] = OrderedDict()
        self._drafts: dict[DraftKey, dict[tuple[str, int], Record]] = {}  # by (request id, choice)
        self._gateways = gateways.GatewayChecks(nc)
        self._reconnected_at = -RECONNECT_GRACE_S  # monotonic: the last reconnect to NATS
        ACTIVE.set_function(lambda: len(self._requests))

    @property
    def num_active(self) -> int:
        return len(self._requests)

    async def on_open(self, msg: Msg) -> None:
        """Takes the request and answers with this detokenizer's id, which routes the request's frames here."""
        try:
            opened = DetokOpen.from_bytes(msg.data)
        except (ValidationError, ValueError) as err:
            BAD_MESSAGES.labels(subject=subjects.DETOK_OPEN).inc()
            log.warning("invalid DetokOpen dropped: %s", err)
            return
        if opened.request_id in self._requests:
            log.warning("request %s opened twice; keeping the first", opened.request_id)
        elif opened.request_id in self._closed:
            # Its Cancel overtook it (the client's subscriptions each have their own queue): nobody awaits its output.
            log.debug("request %s was cancelled before it opened", opened.request_id)
        else:
            self._requests[opened.request_id] = RequestChoices(opened, self._table)
            self._idle.heard(opened.request_id, time.monotonic())
        await msg.respond(DetokReady(detok_id=self.detok_id).to_bytes())

    async def on_cancel(self, msg: Msg) -> None:
        try:
            cancel = Cancel.from_bytes(msg.data)
        except (ValidationError, ValueError) as err:
            BAD_MESSAGES.labels(subject=subjects.CANCEL).inc()
            log.warning("invalid Cancel dropped: %s", err)
            return
        if cancel.choice is not None or cancel.worker_id is not None:  # not the request's end
            return
        if cancel.request_id in self._requests:
            self._close(cancel.request_id)
        elif cancel.request_id not in self._closed:
            self._remember_closed(cancel.request_id)  # its DetokOpen may still be on its way here

    async def on_frame(self, msg: Msg) -> None:
        try:
            frame = decode(msg.data)
        except FrameError as err:
            MALFORMED_FRAMES.labels(reason=err.reason).inc()
            log.warning("malformed frame dropped (%s): %s", err.reason, err)
            return
        FRAMES_BY_KIND[frame.kind].inc()
        if frame.kind == FrameKind.DRAFT:
            self._buffer_drafts(frame)
        elif frame.kind == FrameKind.PROMPT:
            await self._consume_prompts(frame)
        else:
            await self._consume_targets(frame)
        await self._send_releases()

    async def _send_releases(self) -> None:
        """Tells each worker that sent records of a request another worker took over to drop it: it would run the
        request to its end for nothing, and its acknowledgement would take the message from the work queue under
        the new owner, which could then die with nothing left to redeliver."""
        if not self._releases:  # every frame asks: almost always none
            return
        releases, self._releases = self._releases, []
        for release in releases:
            request = self._requests.get(release.request_id)
            if request is None or request.owner == release.worker_id:
                continue  # over, or that worker took it over again while this frame's chunks went out
            RELEASES.inc()
            await self._nc.publish(subjects.STOP, release.to_bytes())

    def _buffer_drafts(self, frame: Frame) -> None:
        drafts = self._drafts.setdefault((frame.worker_id, frame.step), {})
        for request_id, record in frame_records(frame):
            if self._wanted(request_id, frame.worker_id, record):
                drafts[request_id, record.choice] = record

    async def _consume_prompts(self, frame: Frame) -> None:
        """Sends the prompt parts (echo, prompt_logprobs) a PROMPT frame's records complete."""
        for request_id, record in frame_records(frame):
            if self._wanted(request_id, frame.worker_id, record):
                assembler = self._requests[request_id]
                for chunk in assembler.consume_prompt(record):
                    await self._send(assembler, chunk)

    async def _consume_targets(self, frame: Frame) -> None:
        """Turns a TARGET frame's records into chunks and sends them; metrics are counted once per frame."""
        drafts = self._drafts.pop((frame.worker_id, frame.step), {})
        # A DRAFT frame whose TARGET frame was lost would otherwise wait forever.
        for key in [k for k in self._drafts if k[0] == frame.worker_id and k[1] < frame.step]:
            del self._drafts[key]
        num_tokens = num_chunks = 0
        for request_id, record in frame_records(frame):
            if not self._wanted(request_id, frame.worker_id, record):
                continue
            assembler = self._requests[request_id]
            num_tokens += record.num_tokens
            for chunk in assembler.consume_prompt():  # a prompt known from the start goes out before its tokens
                await self._send(assembler, chunk)
            chunk = assembler.consume(record, drafts.get((request_id, record.choice)))
            if chunk is not None:
                await self._send(assembler, chunk)
                num_chunks += 1
        TOKENS.inc(num_tokens)
        if num_chunks:
            CHUNKS.inc(num_chunks)
            LAG.observe(max(0.0, time.time() - frame.sent_at_us / 1e6))

    def _wanted(self, request_id: str, worker_id: int, record: Record) -> bool:
        """Whether this record of a worker is wanted (which keeps its request from being reaped): its request is open
        here and the worker owns it (a record that ends the request wherever it stands comes from whichever worker
        gave up on it). Counts the records of requests never opened here, and those of workers that lost theirs."""
        request = self._requests.get(request_id)
        if request is None:
            if request_id not in self._closed:
                UNKNOWN_REQUEST_FRAMES.inc()
            return False
        if record.seq_no != WHEREVER and not request.from_owner(worker_id):
            STALE_RECORDS.inc()
            now = time.monotonic()
            if now - request.released.get(worker_id, -RELEASE_REPEAT_S) >= RELEASE_REPEAT_S:
                # Again while its records keep coming: a release travels on core NATS, and may be lost.
                request.released[worker_id] = now
                self._releases.append(Cancel(request_id=request_id, reason="taken_over", worker_id=worker_id))
            return False
        self._heard(request_id)
        return True

    def _heard(self, request_id: str) -> None:
        self._idle.heard(request_id, time.monotonic())
        self._unheard.discard(request_id)

    async def on_progress(self, msg: Msg) -> None:
        """A worker takes over a request: answers where its output stands (services/detokenizer/migration.py)."""
        try:
            query = ProgressQuery.from_bytes(msg.data)
        except (ValidationError, ValueError) as err:
            BAD_MESSAGES.labels(subject=subjects.progress(self.detok_id)).inc()
            log.warning("invalid ProgressQuery dropped: %s", err)
            return
        request = self._requests.get(query.request_id)
        report, error = self._migrations.take_over(request, query)
        if request is not None:
            self._heard(query.request_id)
        await msg.respond(report.to_bytes())
        if error is not None:
            await self._send(request, error)

    async def on_held(self, msg: Msg) -> None:
        """A gateway asks which of its silent requests this detokenizer still holds: it is alive, and they are live."""
        try:
            query = HeldQuery.from_bytes(msg.data)
        except (ValidationError, ValueError) as err:
            BAD_MESSAGES.labels(subject=subjects.held(self.detok_id)).inc()
            log.warning("invalid HeldQuery dropped: %s", err)
            return
        held = tuple(request_id for request_id in query.request_ids if request_id in self._requests)
        await msg.respond(HeldReport(request_ids=held).to_bytes())

    async def watch_reconnects(self, reconnected: asyncio.Event) -> None:
        """After each reconnect to NATS, ends the open requests that hear nothing for RECONNECT_GRACE_S: frames
        published while the connection was down may be lost, the last one of a request included."""
        while True:
            await reconnected.wait()
            reconnected.clear()
            self._reconnected_at = time.monotonic()
            self._unheard = set(self._requests)
            await asyncio.sleep(RECONNECT_GRACE_S)
            if reconnected.is_set():
                continue  # connected again meanwhile: the grace starts over
            for request_id in [r for r in self._unheard if r in self._requests]:
                request = self._requests[request_id]
                await self._send(request, request.fail(f"no frame for {RECONNECT_GRACE_S:g} s after NATS reconnected; "
                                                        "the output was lost on the way"))
            self._unheard = set()

    async def _send(self, assembler: RequestChoices, chunk: Chunk) -> None:
        await self._nc.publish(assembler.reply_subject, encode_chunk(chunk))
        if chunk.error is not None:
            log.warning("request %s failed: %s", assembler.request_id, chunk.error)
        if assembler.finished:
            self._close(assembler.request_id)
        for cancel in assembler.take_cancels():
            await self._nc.publish(subjects.STOP, cancel.to_bytes())

    def _close(self, request_id: str) -> None:
        del self._requests[request_id]
        self._idle.forget(request_id)
        self._remember_closed(request_id)

    async def reap(self) -> int:
        """Closes the requests silent for longer than the idle timeout, and stops them at the workers."""
        silent = self._idle.expired(time.monotonic())
        for request_id in silent:
            self._close(request_id)
            await self._nc.publish(subjects.STOP, Cancel(request_id=request_id, reason="error").to_bytes())
            log.warning("request %s had no frame for %g s; closed", request_id, self._idle.idle_timeout_s)
        REAPED.inc(len(silent))
        return len(silent)

    async def reap_loop(self) -> None:
        while True:
            await asyncio.sleep(self._idle.sweep_interval_s)
            await self.reap()

    async def drop_abandoned(self) -> int:
        """Closes the requests no gateway waits for any more (gateways.py), and stops them at the workers."""
        open_requests = [(request_id, request.reply_subject) for request_id, request in self._requests.items()]
        # Just reconnected, the gateways may not have resubscribed yet: their silence means nothing
        settled = time.monotonic() - self._reconnected_at > RECONNECT_GRACE_S
        dropped = 0
        for request_id in await self._gateways.abandoned(open_requests, judge_silence=settled):
            if request_id not in self._requests:  # it ended while the gateways were asked
                continue
            self._close(request_id)
            stop = Cancel(request_id=request_id, reason="client_disconnected")
            await self._nc.publish(subjects.STOP, stop.to_bytes())
            dropped += 1
        ABANDONED.inc(dropped)
        return dropped

    async def gateway_check_loop(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            if not self._requests:
                continue
            try:
                await self.drop_abandoned()
            except Exception:  # the next round asks again; a failing round must not end the checks for good
                log.exception("asking the gateways after their requests failed")

    def _remember_closed(self, request_id: str) -> None:
        self._closed[request_id] = None
        if len(self._closed) > RECENTLY_CLOSED:
            self._closed.popitem(last=False)


def encode_chunk(chunk: Chunk) -> bytes:
    """The chunk's JSON, equal to Chunk.to_bytes() once parsed, at a fraction of its cost: orjson writes the choice
    directly, where model_dump would first copy it value by value (a tenth of the time with logprobs)."""
    # The usage, on the last chunk only, is dumped whole: it may nest the speculation summary.
    return orjson.dumps({**dict(chunk), "usage": None if chunk.usage is None else chunk.usage.model_dump()})
