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
        self._pending: list[tuple[int, str, bytes]] = []  # (sequence number, type, JSON) of each event not yet sent
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
            self._pending.pop(0)
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

    async def kept(self, response_id: str) -> bool:
        """Whether any of the response's events are kept (it was streamed, and they have not aged out)."""
        return await self._kept_after(subjects.response_events(response_id), 0) is not None

    async def follow(self, response_id: str, after: int) -> AsyncIterator[list[Event]]:
        """The response's events numbered above `after`, as they were kept and then as they come, until its last."""
        subject = subjects.response_events(response_id)
        heard: asyncio.Queue[Msg] = asyncio.Queue()

        async def hear(msg: Msg) -> None:
            heard.put_nowait(msg)

        live = await self._nc.subscribe(subject, cb=core_only(hear))
        await barrier(self._nc)  # the subscription is in place before the kept events are read
        reading = _Reading(after)
        try:
            stream_sequence = 0
            while (kept := await self._kept_after(subject, stream_sequence)) is not None:
                stream_sequence, data, headers = kept
                events = reading.take(data, headers)
                if events:
                    yield events
                if reading.ended:
                    return
            idle_since = time.monotonic()
            while not reading.ended:
                try:
                    msg = await asyncio.wait_for(heard.get(), self._idle_check_s)
                except asyncio.TimeoutError:
                    events = await self._ended_without_events(response_id, reading, time.monotonic() - idle_since)
                else:
                    idle_since = time.monotonic()
                    events = reading.take(msg.data, msg.headers)
                if events:
                    yield events
        finally:
            await live.unsubscribe()

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

    def take(self, data: bytes, headers: dict | None) -> list[Event]:
        """The events of one kept message it has not seen yet."""
        if headers and END_HEADER in headers:
            self.ended = True
            return []
        fresh = [event for event in wire_json.loads(data) if event["sequence_number"] > self.last]
        if fresh:
            self.last = fresh[-1]["sequence_number"]
        self.ended = any(event["type"] in TERMINAL_EVENTS.values() for event in fresh)  # nothing follows them
        return [event for event in fresh if event["sequence_number"] > self.after]


def _too_large(sequence_number: int, kind: str, size: int) -> Event:
    return {
        "type": "error", "sequence_number": sequence_number, "code": EVENT_TOO_LARGE, "param": None,
        "message": f"the {kind} event ({size} bytes) is over NATS's max_payload and was not kept; "
                   "GET the response without stream for what it carried",
    }
