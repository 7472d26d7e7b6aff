"""Background responses (`background: true`, OpenAI's): the request is answered once it is validated and counted
against its client's bound, with the response `queued`, and runs on in this gateway detached from its HTTP exchange,
kept in the store as it goes (store.py): `in_progress` once it is admitted, written again every HEARTBEAT_S, then
`completed`, `incomplete`, `failed` or `cancelled`. GET /v1/responses/{id} polls it from any gateway; POST
/v1/responses/{id}/cancel stops it from any gateway (the one running it answers a NATS request on
subjects.CANCEL_BACKGROUND), and so does DELETE before it removes the entry. One created with `stream: true` also
appends its events to the event log (event_log.py) as it goes, its last after its last state is stored.

A gateway that dies takes its runs with it: their entries stop being written, and a response whose heartbeat is older
than STALE_AFTER_S reads as `failed`, naming why, instead of `in_progress` for ever (the gateways' clocks are taken to
agree within it). A stopping gateway fails its runs, saying so.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError, TimeoutError as NatsTimeoutError

from services.gateway.cancelling import cancel_until_done, to_the_end
from services.gateway.errors import SERVER_ERROR, OpenAIError
from services.gateway.responses.event_log import EventWriter
from services.gateway.responses.output import ResponseOutput
from services.gateway.responses.store import RUNNING_STATUSES, STALE_AFTER_S, ResponseStore, StoredRecord
from shared import subjects
from shared.natsutil import core_only

log = logging.getLogger(__name__)

HEARTBEAT_S = STALE_AFTER_S / 4  # how often a running response's entry is written again
CANCEL_TIMEOUT_S = 2.0  # how long a cancel waits for the gateway running the response
CANCELLED_REPLY = b"cancelled"
STOPPED = {"code": SERVER_ERROR, "message": "the gateway running this background response was stopped"}
Renamer = Callable[[OpenAIError], OpenAIError]


class BackgroundRun:
    """One background response's entry in the store, written as it goes and never after its last state: a heartbeat
    that lost the race to the final write does not bring `in_progress` back."""

    def __init__(self, store: ResponseStore, record: StoredRecord, events: EventWriter | None = None) -> None:
        self._store = store
        self.record = record
        self.events = events  # a streamed one's (event_log.py)
        self._lock = asyncio.Lock()
        self._final = False
        self._written = False
        self.started = False  # its task took its first step (one cancelled before never awaits what it serves)
        self.ending = False  # it took a cancellation and writes how it ended

    async def write(self, response: dict[str, Any], final: bool = False, first: bool = False) -> bool | None:
        """Whether the entry now holds this state; None where it was not written (after the last state, or `first`
        (the `queued` entry, which a run admitted at once skips) after any other)."""
        async with self._lock:
            if self._final or (first and self._written):
                return None
            self._final, self._written = final, True
            self.record = StoredRecord(response, self.record.turn, self.record.items, heartbeat=time.time())
            if await self._store.keep(self.record):
                return True
            if final:
                # The last state must reach the store, or the entry would later read as a gateway gone: without its
                # output and input (over the store's message size, most likely), saying why.
                error = {"code": SERVER_ERROR, "message": "the response was too large for the response store (over "
                         "NATS's max_payload) or the store could not be written; it was kept without its output and "
                         "its input"}
                kept = {**response, "status": "failed", "error": error, "output": []}
                self.record = StoredRecord(kept, [], [], heartbeat=time.time())
                await self._store.keep(self.record)
            return False

    @property
    def ended(self) -> bool:
        """Its last state was written, or is being written."""
        return self._final

    async def close_events(self) -> None:
        if self.events is not None:
            await self.events.close()

    async def beat(self, output: Callable[[], ResponseOutput]) -> None:
        """Writes the response as it stands every HEARTBEAT_S until cancelled."""
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            await self.write(output().snapshot())


class BackgroundRuns:
    """This gateway's background responses, by id."""

    def __init__(self, nc: Client, store: ResponseStore) -> None:
        self._nc = nc
        self._store = store
        # Each run's task, entry, output so far and what it serves, by response id
        self._runs: dict[
            str, tuple[asyncio.Task, BackgroundRun, Callable[[], ResponseOutput], Coroutine[Any, Any, Any]]
        ] = {}
        self._stopping = False

    async def start(self) -> None:
        await self._nc.subscribe(subjects.CANCEL_BACKGROUND, cb=core_only(self._on_cancel))

    async def stop(self) -> None:
        """Fails the runs still going (a drain fails those it reaches first, as the gateway's other requests), while
        the store can still be written."""
        self._stopping = True
        await asyncio.gather(*(self._cancel_here(response_id) for response_id in list(self._runs)))

    def run(
        self, run: BackgroundRun, serve: Coroutine[Any, Any, Any], output: Callable[[], ResponseOutput],
        validated: asyncio.Event, rename: Renamer,
    ) -> asyncio.Task:
        response_id = run.record.response["id"]
        work = _run_detached(run, serve, output, validated, rename, self._ending)
        task = asyncio.create_task(work, name=f"background {response_id}")
        self._runs[response_id] = task, run, output, serve
        task.add_done_callback(lambda _: self._runs.pop(response_id, None))
        return task

    async def cancel(self, response_id: str) -> StoredRecord:
        """Stops the response where it runs and returns its entry; one already ended is returned as it is."""
        if not await self._cancel_here(response_id):
            record, revision = await self._store.get_entry(response_id)
            if record.as_read is not record:  # its gateway is gone: the failure readers see becomes the entry
                await self._store.replace(record.as_read, revision)
                return (await self._store.get(response_id)).as_read
            if record.response.get("status") not in RUNNING_STATUSES:
                return record
            try:
                await self._nc.request(subjects.CANCEL_BACKGROUND, response_id.encode(), timeout=CANCEL_TIMEOUT_S)
            except (NatsTimeoutError, NoRespondersError):  # nobody runs it: it ended meanwhile, or its gateway is gone
                response = {**record.response, "status": "cancelled"}
                # Unless the entry changed since it was read (the run ended meanwhile): that end stands
                await self._store.replace(StoredRecord(response, record.turn, record.items, heartbeat=time.time()),
                                          revision)
        return (await self._store.get(response_id)).as_read

    def _ending(self) -> tuple[str, dict | None]:
        """How a run stopped here ends: failed when the gateway stops, cancelled when asked."""
        return ("failed", STOPPED) if self._stopping else ("cancelled", None)

    async def _cancel_here(self, response_id: str) -> bool:
        if response_id not in self._runs:
            return False
        task, run, output, serve = self._runs[response_id]
        await cancel_until_done(task, cancellable=lambda: not run.ending)
        if not run.started:  # cancelled before its first step: it ran none of its own ending
            serve.close()
            await _end(run, output(), *self._ending())
            await run.close_events()
        return True

    async def _on_cancel(self, msg: Msg) -> None:
        if await self._cancel_here(msg.data.decode()):
            await msg.respond(CANCELLED_REPLY)


async def _run_detached(
    run: BackgroundRun, serve: Awaitable[Any], output: Callable[[], ResponseOutput], validated: asyncio.Event,
    rename: Renamer, ending: Callable[[], tuple[str, dict | None]],
) -> None:
    """Serves the response and writes how it ended: the answer's own last write (completed or incomplete), or
    `failed` with the error (under the Responses API's parameter names), or `cancelled`. Until `validated` is set
    (the request passed every check) nothing is written, and an error is raised as it is, for the client to hear."""
    run.started = True
    beating = asyncio.create_task(_beat_once_validated(run, output, validated))
    try:
        await serve
    except asyncio.CancelledError:
        run.ending = True
        if validated.is_set():
            await asyncio.shield(_end(run, output(), *ending()))
        raise
    except OpenAIError as exc:
        if not validated.is_set():
            raise
        await _end(run, output(), "failed", rename(exc).body()["error"])
    except Exception:
        if not validated.is_set():
            raise
        log.exception("background response %s failed", run.record.response["id"])
        await _end(run, output(), "failed", OpenAIError(500, "Internal error", type=SERVER_ERROR).body()["error"])
    finally:
        beating.cancel()
        await to_the_end(run.close_events())


async def _beat_once_validated(
    run: BackgroundRun, output: Callable[[], ResponseOutput], validated: asyncio.Event
) -> None:
    await validated.wait()
    await run.beat(output)


async def _end(run: BackgroundRun, output: ResponseOutput, status: str, error: dict | None = None) -> None:
    """Writes the response's last state, `failed` with the error or `cancelled`, and its events (a streamed one's);
    nothing where its answer wrote its last state (completed, or incomplete) before the cancellation came."""
    if run.ended:
        return
    events = output.fail(error) if status == "failed" else output.cancel()
    if await run.write(output.snapshot(), final=True) is not None and run.events is not None:
        run.events.put(events)
