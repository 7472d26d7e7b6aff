"""A streamed background response's event log (services/gateway/responses/event_log.py) on a real NATS server with
the gateway's user and permissions: read back whole or after a sequence number, by a reader on another
connection (another gateway), heard as it grows, with what is kept twice read once, an event too large for a
message replaced by an error naming it, and a stream whose gateway died ended by the store's reading of it."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from services.gateway import wire_json
from services.gateway.responses.answer import ResponsesAnswer
from services.gateway.responses.background import BackgroundRun, BackgroundRuns
from services.gateway.responses.event_log import END_HEADER, EVENT_TOO_LARGE, EventLog, _Reading
from services.gateway.responses.output import ResponseOutput
from services.gateway.responses.store import STALE_AFTER_S, ResponseStore, StoredRecord
from shared.nats_roles import NatsRole
from shared.stream_limits import StreamLimits
from tests.natsfixture import NatsServer, nats_server, running_nats_server

__all__ = ["nats_server"]  # a fixture, imported for pytest to find

IDLE_CHECK_S = 0.2
FOLLOW_TIMEOUT_S = 10.0


def _answer(response_id: str, words: list[str]) -> tuple[ResponseOutput, list[list[dict[str, Any]]]]:
    """A background response's events as its run makes them: queued, in progress, a delta per word, completed."""
    output = ResponseOutput(response_id, int(time.time()), {"background": True})
    output.status = "queued"
    batches = [output.queued(), output.progressing()]
    batches += [output.feed({"delta": {"content": word}}) for word in words]
    usage = {"input_tokens": 1, "output_tokens": len(words), "total_tokens": 1 + len(words)}
    batches.append(output.finish("stop", usage))
    return output, batches


async def _followed(log: EventLog, response_id: str, after: int = -1) -> list[dict[str, Any]]:
    async def read() -> list[dict[str, Any]]:
        return [event async for events in log.follow(response_id, after) for event in events]
    return await asyncio.wait_for(read(), FOLLOW_TIMEOUT_S)


@pytest.fixture
async def gateways(nats_server: NatsServer):
    """Two gateways' connections: one runs responses, the other reads them."""
    running, reading = [await nats_server.connect_as(NatsRole.GATEWAY) for _ in range(2)]
    yield running, reading
    await running.close()
    await reading.close()


async def test_kept_events_are_read_whole_or_after_a_sequence_number_through_another_gateway(gateways) -> None:
    running, reading = gateways
    _, batches = _answer("resp_whole", ["def", " f", "():"])
    writer = EventLog(running, ResponseStore(running)).writer("resp_whole")
    for batch in batches:
        writer.put(batch)
    await writer.close()
    log = EventLog(reading, ResponseStore(reading), idle_check_s=IDLE_CHECK_S)
    events = [event for batch in batches for event in batch]
    assert await _followed(log, "resp_whole") == events
    assert await _followed(log, "resp_whole", after=4) == events[5:]
    assert await _followed(log, "resp_whole", after=len(events) + 3) == []
    assert await log.first_kept("resp_whole") == 0 and await log.first_kept("resp_never_streamed") is None


async def test_a_reader_hears_the_events_as_they_come_and_each_once(gateways) -> None:
    running, reading = gateways
    output, batches = _answer("resp_live", ["a", "b", "c", "d"])
    writer = EventLog(running, ResponseStore(running)).writer("resp_live")
    writer.put(batches[0])
    store = ResponseStore(reading)
    await store.keep(StoredRecord({**output.snapshot(), "status": "in_progress"}, [], [], heartbeat=time.time()))
    log = EventLog(reading, store, idle_check_s=IDLE_CHECK_S)
    following = asyncio.create_task(_followed(log, "resp_live"))
    await asyncio.sleep(0.2)  # it reads what is kept, then waits for more
    for batch in batches[1:]:
        writer.put(batch)
        await asyncio.sleep(0.01)
    await writer.close()
    assert await following == [event for batch in batches for event in batch]


async def test_an_event_too_large_for_a_message_is_an_error_in_its_place(gateways) -> None:
    running, reading = gateways
    output, batches = _answer("resp_huge", ["x" * running.max_payload])
    writer = EventLog(running, ResponseStore(running)).writer("resp_huge")
    for batch in batches:
        writer.put(batch)
    await writer.close()
    events = await _followed(EventLog(reading, ResponseStore(reading), idle_check_s=IDLE_CHECK_S), "resp_huge")
    sent = [event for batch in batches for event in batch]
    assert [event["sequence_number"] for event in events] == [event["sequence_number"] for event in sent]
    errors = [event for event in events if event["type"] == "error"]
    # The delta, the text's end, its part's and its item's all carry the text; the completed response too
    assert {error["code"] for error in errors} == {EVENT_TOO_LARGE} and len(errors) == 5
    assert "response.output_text.delta" in errors[0]["message"]


async def test_a_stream_whose_gateway_died_ends_as_the_store_reads_the_response(gateways) -> None:
    running, reading = gateways
    output, batches = _answer("resp_gone", ["a", "b"])
    log = EventLog(running, ResponseStore(running))
    writer = log.writer("resp_gone")
    for batch in batches[:3]:  # then its gateway died: no more events, and no end
        writer.put(batch)
    while await log.first_kept("resp_gone") is None:  # what was put is kept
        await asyncio.sleep(0.01)
    store = ResponseStore(reading)
    in_progress = {**output.snapshot(), "status": "in_progress"}
    await store.keep(StoredRecord(in_progress, [], [], heartbeat=time.time() - STALE_AFTER_S - 1))
    events = await _followed(EventLog(reading, store, idle_check_s=IDLE_CHECK_S), "resp_gone")
    sent = [event for batch in batches[:3] for event in batch]
    assert events[:-1] == sent
    assert events[-1]["type"] == "response.failed" and events[-1]["sequence_number"] == sent[-1]["sequence_number"] + 1
    assert events[-1]["response"]["status"] == "failed" and "stopped" in events[-1]["response"]["error"]["message"]
    await writer.close()


class SlowAckStore(ResponseStore):
    """A store whose last write of a completed response is sent at once and acknowledged late (a busy server)."""

    def __init__(self, nc, sent: asyncio.Event) -> None:
        super().__init__(nc)
        self.sent = sent

    async def keep(self, record: StoredRecord) -> bool:
        kept = await super().keep(record)
        if record.response["status"] == "completed":
            self.sent.set()
            await asyncio.sleep(0.5)
        return kept


async def test_a_cancel_during_the_last_write_leaves_the_response_ended_and_its_events_whole(gateways) -> None:
    """The answer's last write is under way when the cancel comes: the response stays completed, in the store and
    in its stream, which ends with response.completed (a cancel came too late to stop it)."""
    running, reading = gateways
    sent = asyncio.Event()
    store = SlowAckStore(running, sent)
    runs = BackgroundRuns(running, store)
    await runs.start()
    output = ResponseOutput("resp_last_write", int(time.time()), {"background": True})
    output.status = "queued"
    writer = EventLog(running, store).writer("resp_last_write")
    run = BackgroundRun(store, StoredRecord(output.snapshot(), [], [], heartbeat=time.time()), writer)

    async def keep(kept: ResponseOutput) -> bool:
        return await run.write(kept.snapshot(), final=True)

    answer = ResponsesAnswer({"background": True}, False, lambda ids, text: 0, keep=keep, output=output,
                             events=writer.put)

    async def serve() -> None:  # as the answer of a validated request
        writer.put(output.queued())
        writer.put(output.progressing())
        answer._emit(output.feed({"delta": {"content": "hello"}}))
        answer._emit(await answer._finish("stop", {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2}))

    validated = asyncio.Event()
    validated.set()
    task = runs.run(run, serve(), lambda: output, validated, lambda exc: exc)
    await asyncio.wait_for(sent.wait(), 5)
    cancelled = await runs.cancel("resp_last_write")
    assert cancelled.response["status"] == "completed" and task.done()
    assert (await ResponseStore(reading).get("resp_last_write")).response["status"] == "completed"
    events = await _followed(EventLog(reading, ResponseStore(reading), idle_check_s=IDLE_CHECK_S), "resp_last_write")
    assert events[-1]["type"] == "response.completed"
    assert [event["sequence_number"] for event in events] == list(range(len(events)))


async def test_a_log_that_dropped_a_responses_first_events_says_where_they_start(tmp_path) -> None:
    """The log drops its oldest messages first when it is full: a reader asks where a response's kept events start
    (GET then refuses to stream from before there)."""
    limits = StreamLimits(response_store_max_bytes=64 * 1024)
    with running_nats_server(tmp_path / "nats", limits=limits) as server:
        nc = await server.connect_as(NatsRole.GATEWAY)
        try:
            log = EventLog(nc, ResponseStore(nc))
            writer = log.writer("resp_long")
            for batch in _answer("resp_long", ["word "] * 400)[1]:
                writer.put(batch)
                await asyncio.sleep(0.001)  # a message per batch, as a run's chunks come
            await writer.close()
            assert (await log.first_kept("resp_long") or 0) > 0
        finally:
            await nc.close()


def test_a_message_heard_ahead_of_what_was_read_sends_the_reader_back_to_the_log() -> None:
    reading = _Reading(after=-1)
    _, batches = _answer("resp_gap", ["a", "b", "c"])
    assert reading.follows_on(wire_json.dumps(batches[0]), None)
    reading.take(wire_json.dumps(batches[0]), None)
    assert reading.follows_on(wire_json.dumps(batches[1]), None)
    assert not reading.follows_on(wire_json.dumps(batches[2]), None)  # batches[1] was not read
    assert not reading.follows_on(b"[]", {END_HEADER: "1"})  # the end: once all that is kept is read
