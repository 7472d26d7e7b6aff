"""A streamed background response's events, kept so that a client whose connection dropped picks the stream up
again where it left it, through any gateway: GET /v1/responses/{id}?stream=true&starting_after=N (OpenAI's
resumable streaming).

The gateway running the response appends its events to a JetStream stream, a subject per response
(shared/subjects.py RESPONSE_EVENTS_STREAM, declared with the response store and kept as long), each message a JSON
list of the events one chunk made, and an empty list with END_HEADER after the last. A reader hears new messages
on the subject before it reads back the kept ones (direct gets), so nothing appended while it catches up is missed;
the events' own sequence numbers drop what it gets twice.

A gateway that dies takes its response's last events with it: a reader that hears nothing for a while asks the
store, and ends the stream with the response as the store reads it (failed, once its heartbeat is stale) instead
of waiting for ever.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError

from services.gateway import wire_json
from services.gateway.errors import OpenAIError
from services.gateway.responses.store import RUNNING_STATUSES, STALE_AFTER_S, ResponseStore
from shared import subjects
from shared.natsutil import barrier, core_only

log = logging.getLogger(__name__)

Event = dict[str, Any]

END_HEADER = "Specmesh-Events-End"  # on the message (an empty list) after a response's last event
LIST_OPEN, LIST_SEPARATOR, LIST_CLOSE = b"[", b",", b"]"
# Room left under max_payload for a message's headers and framing
HEADROOM_BYTES = 1024
IDLE_CHECK_S = 5.0  # how long a reader waits for an event before it asks the store whether the response ended
# The Responses API's event for a response that ended this way (a cancelled one has none: its stream just ends)
TERMINAL_EVENTS = {"completed": "response.completed", "incomplete": "response.incomplete",
                   "failed": "response.failed"}
EVENT_TOO_LARGE = "event_too_large"


class EventWriter:
    """Appends one response's events in the order they were put, without making the response wait on JetStream's
    acknowledgements."""

    def __init__(self, nc: Client, response_id: str) -> None:
        self._nc = nc
        self._js = nc.jetstream()
        self._subject = subjects.response_events(response_id)
        self._response_id = response_id
        self._pending: deque[tuple[int, str, bytes]] = deque()  # (sequence number, type, JSON) of each event unsent
        self._wake = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task | None = None

    def put(self, events: list[Event]) -> None:
        if self._closing:
            raise RuntimeError(f"response {self._response_id}'s events were put after its last")
        self._pending += [(event["sequence_number"], event["type"], wire_json.dumps(event)) for event in events]
        if self._task is None:
            self._task = asyncio.create_task(self._drain(), name=f"events of {self._response_id}")
        self._wake.set()

    async def close(self) -> None:
        """Appends what is left and the end marker (none for a response that put no event: nobody can read it)."""
        self._closing = True
        self._wake.set()
        if self._task is not None:
            await self._task

    async def _drain(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                await self._publish(self._next_message())
            if self._closing:
                await self._publish(LIST_OPEN + LIST_CLOSE, headers={END_HEADER: "1"})
                return

    def _next_message(self) -> bytes:
        """The pending events that fit one NATS message, as a JSON list; one too large for any is replaced by an
        `error` event naming it (the response itself, from the store, still has what it carried)."""
        limit = self._nc.max_payload - HEADROOM_BYTES
        taken: list[bytes] = []
        size = len(LIST_OPEN) + len(LIST_CLOSE)
        while self._pending:
            sequence_number, kind, data = self._pending[0]
            if len(data) + size + len(LIST_SEPARATOR) > limit:
                if taken:
                    break
                data = wire_json.dumps(_too_large(sequence_number, kind, len(data)))
            taken.append(data)
            size += len(data) + len(LIST_SEPARATOR)
            self._pending.popleft()
        return LIST_OPEN + LIST_SEPARATOR.join(taken) + LIST_CLOSE

    async def _publish(self, data: bytes, headers: dict[str, str] | None = None) -> None:
        try:
            await self._js.publish(self._subject, data, headers=headers)
        except Exception as exc:  # readers then end the stream from the store, once it shows the response ended
            log.warning("events of background response %s were not kept: %r", self._response_id, exc)


class EventLog:
    """The gateways' log of streamed background responses' events."""

    def __init__(self, nc: Client, store: ResponseStore, idle_check_s: float = IDLE_CHECK_S) -> None:
        self._nc = nc
        self._js = nc.jetstream()
        self._store = store
        self._idle_check_s = idle_check_s

    def writer(self, response_id: str) -> EventWriter:
        return EventWriter(self._nc, response_id)

    async def first_kept(self, response_id: str) -> int | None:
        """The sequence number of the response's first event still kept; None where none is (it was not streamed,
        or they aged out). The log drops its oldest messages first: what is kept runs from there to the last."""
        subject, cursor = subjects.response_events(response_id), 0
        while (kept := await self._kept_after(subject, cursor)) is not None:
            cursor, data, _ = kept
            if events := wire_json.loads(data):
                return events[0]["sequence_number"]
        return None  # none, or only the end marker

    async def follow(self, response_id: str, after: int) -> AsyncIterator[list[Event]]:
        """The response's events numbered above `after`, as they were kept and then as they come, until its last.

        Messages heard on the subject carry events as they are appended; where one does not follow on from what was
        read (JetStream may store a message after it was delivered, so one appended as this reader subscribed can be
        missing from the kept ones it read), and at its end, the kept ones are read again from where the reader was."""
        subject = subjects.response_events(response_id)
        heard: asyncio.Queue[Msg] = asyncio.Queue()

        async def hear(msg: Msg) -> None:
            heard.put_nowait(msg)

        live = await self._nc.subscribe(subject, cb=core_only(hear))
        try:
            await barrier(self._nc)  # the subscription is in place before the kept events are read
            reading, cursor = _Reading(after), 0
            behind, idle_since = True, time.monotonic()
            msg: Msg | None = None
            while True:
                while behind and (kept := await self._kept_after(subject, cursor)) is not None:
                    cursor, data, headers = kept
                    if events := reading.take(data, headers):
                        yield events
                    if reading.ended:
                        return
                if msg is not None:  # heard ahead of what was kept: taken once they are read
                    if events := reading.take(msg.data, msg.headers):
                        yield events
                    if reading.ended:
                        return
                try:
                    msg = await asyncio.wait_for(heard.get(), self._idle_check_s)
                except asyncio.TimeoutError:
                    msg, behind = None, True  # what was missed is kept by now
                    if events := await self._ended_without_events(response_id, reading, time.monotonic() - idle_since):
                        yield events
                    if reading.ended:
                        return
                    continue
                idle_since = time.monotonic()
                behind = not reading.follows_on(msg.data, msg.headers)
        finally:
            await live.unsubscribe()

    async def purge(self, response_id: str) -> None:
        """Drops the response's events (it was deleted)."""
        await self._js.purge_stream(subjects.RESPONSE_EVENTS_STREAM, subject=subjects.response_events(response_id))

    async def _kept_after(self, subject: str, stream_sequence: int) -> tuple[int, bytes, dict | None] | None:
        """The subject's first kept message after `stream_sequence`: its sequence, data and headers."""
        try:
            msg = await self._js.get_msg(subjects.RESPONSE_EVENTS_STREAM, seq=stream_sequence + 1, subject=subject,
                                         next=True, direct=True)
        except NotFoundError:
            return None
        return msg.seq, msg.data or b"", msg.headers

    async def _ended_without_events(self, response_id: str, reading: "_Reading", idle_s: float) -> list[Event]:
        """The stream's end where the store says the response ended and its last events will not come: its gateway
        is gone (the entry reads as failed), or it ended a while ago and they never came, or it was deleted."""
        try:
            stored = await self._store.get(response_id)
        except OpenAIError:  # deleted meanwhile
            reading.ended = True
            return []
        except Exception as exc:  # the store does not answer now: nothing tells the response ended
            log.warning("the store did not say whether response %s ended: %r", response_id, exc)
            return []
        record = stored.as_read
        status = record.response.get("status")
        if status in RUNNING_STATUSES or (record is stored and idle_s < STALE_AFTER_S):
            return []
        reading.ended = True
        if status not in TERMINAL_EVENTS:
            return []
        return [{"type": TERMINAL_EVENTS[status], "sequence_number": reading.last + 1, "response": record.response}]


class _Reading:
    """Where a reader is in a response's events: the last sequence number it has seen, and whether they ended."""

    def __init__(self, after: int) -> None:
        self.after = after
        self.last = -1
        self.ended = False

    def follows_on(self, data: bytes, headers: dict | None) -> bool:
        """Whether a message heard holds nothing that would leave events unseen before it (the end marker is taken
        only once every kept message was read)."""
        if headers and END_HEADER in headers:
            return False
        events = wire_json.loads(data)
        return not events or events[0]["sequence_number"] <= self.last + 1

    def take(self, data: bytes, headers: dict | None) -> list[Event]:
        """The events of one message it has not seen yet."""
        if headers and END_HEADER in headers:
            self.ended = True
            return []
        fresh = [event for event in wire_json.loads(data) if event["sequence_number"] > self.last]
        if fresh:
            self.last = fresh[-1]["sequence_number"]
        # Nothing follows a response's own end
        self.ended = self.ended or any(event["type"] in TERMINAL_EVENTS.values() for event in fresh)
        return [event for event in fresh if event["sequence_number"] > self.after]


def _too_large(sequence_number: int, kind: str, size: int) -> Event:
    return {
        "type": "error", "sequence_number": sequence_number, "code": EVENT_TOO_LARGE, "param": None,
        "message": f"the {kind} event ({size} bytes) is over NATS's max_payload and was not kept; "
                   "GET the response without stream for what it carried",
    }
