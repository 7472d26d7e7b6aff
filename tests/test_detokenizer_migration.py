"""A request moving between workers, at the real detokenizer service over a real nats-server: the worker taking it
over learns where its output stands, the previous worker's late frames are dropped, migrations are bounded; and a
gateway learns which of its requests the detokenizer holds."""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.client import Client

from shared import subjects
from shared.frames import FinishReason, FrameBuilder, FrameKind
from shared.natsutil import barrier
from shared.schemas import Cancel, ChoiceProgress, HeldQuery, HeldReport, ProgressQuery, ProgressReport, TakeOver
from shared.tokenizer import Tokenizer
from services.detokenizer.handlers import RELEASE_REPEAT_S
from services.detokenizer.migration import DEFAULT_MAX_MIGRATIONS
from tests.natsfixture import nats_server  # noqa: F401  (fixtures are used by name)
from tests.test_detokenizer_service import (  # noqa: F401
    DETOK_ID, RECEIVE_TIMEOUT_S, SILENCE_S, TOP_K, WORKER_ID, Worker, counter, model_dir, nc, next_chunk, open_request,
    tokenizer, until_final,
)

NEW_WORKER_ID = WORKER_ID + 5


async def publish_target(nc: Client, worker_id: int, step: int, request_id: str, ids: list[int], **fields) -> None:
    target = FrameBuilder(FrameKind.TARGET, worker_id, step, TOP_K)
    Worker.add(target, request_id, ids, **fields)
    await nc.publish(subjects.frames(DETOK_ID), target.encode())


async def ask_progress(
    nc: Client, request_id: str, worker_id: int, handoff_from: int | None = None, **fields
) -> ProgressReport:
    query = ProgressQuery(request_id=request_id, worker_id=worker_id, handoff_from=handoff_from, **fields)
    reply = await nc.request(subjects.progress(DETOK_ID), query.to_bytes(), timeout=RECEIVE_TIMEOUT_S)
    return ProgressReport.from_bytes(reply.data)


async def streaming(nc: Client, tokenizer: Tokenizer) -> str:
    """A request open at the detokenizer whose first piece of output WORKER_ID sent and its client received."""
    request_id, chunks = await open_request(nc, api="completion")
    await barrier(nc)
    await publish_target(nc, WORKER_ID, 1, request_id, tokenizer.encode("def f(x", add_special_tokens=False),
                         seq_no=0, offset=0)
    await next_chunk(chunks)
    return request_id


async def test_a_worker_taking_over_continues_from_the_output_sent(nc: Client, tokenizer: Tokenizer) -> None:
    request_id, chunks = await open_request(nc, api="completion")
    await barrier(nc)
    first = tokenizer.encode("def f(x", add_special_tokens=False)
    second = tokenizer.encode("):\n    return x", add_special_tokens=False)
    await publish_target(nc, WORKER_ID, 1, request_id, first, seq_no=0, offset=0)
    assert (await next_chunk(chunks)).choice["text"] == "def f(x"

    report = await ask_progress(nc, request_id, NEW_WORKER_ID)
    assert report == ProgressReport(
        outcome=TakeOver.CONTINUE, progress=(ChoiceProgress(index=0, output_token_ids=tuple(first), next_seq_no=1),),
        migrations=1,
    )
    stale_before = counter("specmesh_detokenizer_stale_records_total")
    stops: asyncio.Queue = asyncio.Queue()
    await nc.subscribe(subjects.STOP, cb=stops.put)
    await barrier(nc)
    # The worker that lost the request is still alive and sends its next steps: dropped, and it is told, once, to
    # drop the request without settling its message; told again if it still sends a while later (the release went
    # on core NATS, and may have been lost).
    stale = tokenizer.encode(" + 1", add_special_tokens=False)
    for step in (2, 3):
        await publish_target(nc, WORKER_ID, step, request_id, stale, seq_no=step - 1, offset=len(first))
    release = Cancel.from_bytes((await asyncio.wait_for(stops.get(), RECEIVE_TIMEOUT_S)).data)
    assert release == Cancel(request_id=request_id, reason="taken_over", worker_id=WORKER_ID)
    await asyncio.sleep(RELEASE_REPEAT_S)
    await publish_target(nc, WORKER_ID, 4, request_id, stale, seq_no=3, offset=len(first))
    assert Cancel.from_bytes((await asyncio.wait_for(stops.get(), RECEIVE_TIMEOUT_S)).data) == release
    await publish_target(nc, NEW_WORKER_ID, 1, request_id, second, seq_no=1, offset=len(first),
                         finish=FinishReason.LENGTH)
    (chunk,) = await until_final(chunks)
    assert chunk.choice["text"] == "):\n    return x" and chunk.usage.completion_tokens == len(first) + len(second)
    assert counter("specmesh_detokenizer_stale_records_total") == stale_before + 3 and stops.empty()
    assert (await ask_progress(nc, request_id, WORKER_ID)).outcome is TakeOver.CLOSED


async def test_a_worker_that_lost_a_request_again_is_released_again(nc: Client, tokenizer: Tokenizer) -> None:
    """Released, then the owner again (the request came back to it), then lost once more: a second release, or it
    would run the request to its end and acknowledge it under the new owner."""
    request_id, chunks = await open_request(nc, api="completion")
    stops: asyncio.Queue = asyncio.Queue()
    await nc.subscribe(subjects.STOP, cb=stops.put)
    await barrier(nc)
    ids = tokenizer.encode("ab", add_special_tokens=False)
    await publish_target(nc, WORKER_ID, 1, request_id, ids, seq_no=0, offset=0)
    await next_chunk(chunks)
    for step, new_owner in ((2, NEW_WORKER_ID), (3, NEW_WORKER_ID + 1)):
        assert (await ask_progress(nc, request_id, new_owner)).outcome is TakeOver.CONTINUE
        await publish_target(nc, WORKER_ID, step, request_id, ids, seq_no=1, offset=len(ids))  # stale
        release = Cancel.from_bytes((await asyncio.wait_for(stops.get(), RECEIVE_TIMEOUT_S)).data)
        assert release.worker_id == WORKER_ID and release.reason == "taken_over"
        if step == 2:
            assert (await ask_progress(nc, request_id, WORKER_ID)).outcome is TakeOver.CONTINUE  # it came back
    await nc.publish(subjects.CANCEL, Cancel(request_id=request_id, reason="client_disconnected").to_bytes())


async def test_a_request_that_keeps_losing_its_worker_ends_with_an_error(nc: Client) -> None:
    request_id, chunks = await open_request(nc, api="completion")
    stops: asyncio.Queue = asyncio.Queue()
    await nc.subscribe(subjects.STOP, cb=stops.put)
    await barrier(nc)
    for migration in range(1, DEFAULT_MAX_MIGRATIONS + 1):
        report = await ask_progress(nc, request_id, NEW_WORKER_ID + migration)
        assert report.outcome is TakeOver.CONTINUE and report.migrations == migration
    refused_before = counter("specmesh_detokenizer_migrations_refused_total")
    report = await ask_progress(nc, request_id, WORKER_ID)
    assert report.outcome is TakeOver.REFUSED and report.migrations == DEFAULT_MAX_MIGRATIONS
    (chunk,) = await until_final(chunks)
    assert "--max-migrations" in chunk.error
    assert counter("specmesh_detokenizer_migrations_refused_total") == refused_before + 1
    assert request_id.encode() in (await asyncio.wait_for(stops.get(), RECEIVE_TIMEOUT_S)).data


async def test_a_handoff_from_the_owner_is_no_migration_and_one_from_another_is(
    nc: Client, tokenizer: Tokenizer
) -> None:
    """A prefill worker hands its request to a decode worker: not counted. A stale handoff (the prefill worker no
    longer owns the request) is an ordinary take-over, counted and bounded."""
    request_id, chunks = await open_request(nc, api="completion")
    await barrier(nc)
    first = tokenizer.encode("def f(x", add_special_tokens=False)
    await publish_target(nc, WORKER_ID, 1, request_id, first, seq_no=0, offset=0)
    await next_chunk(chunks)
    handed = await ask_progress(nc, request_id, NEW_WORKER_ID, handoff_from=WORKER_ID)
    assert handed.outcome is TakeOver.CONTINUE and handed.migrations == 0
    stale = await ask_progress(nc, request_id, NEW_WORKER_ID + 1, handoff_from=WORKER_ID)
    assert stale.outcome is TakeOver.CONTINUE and stale.migrations == 1
    # Closed here: an open request would hold the module's detokenizer in its drain (60 s) when the module ends.
    await nc.publish(subjects.CANCEL, Cancel(request_id=request_id, reason="client_disconnected").to_bytes())


async def test_a_delivery_its_handoff_replaced_is_closed_not_taken_over(nc: Client, tokenizer: Tokenizer) -> None:
    """A prefill worker that dies after handing its request off, before acknowledging its own delivery of it: that
    delivery comes back to another worker, whose take-over is closed (the request lives on where it was handed),
    not a migration that would take the request from its decode worker."""
    request_id = await streaming(nc, tokenizer)
    prefill_delivery = "SPECMESH_REQUESTS:7"
    handed = await ask_progress(nc, request_id, NEW_WORKER_ID, handoff_from=WORKER_ID, delivery="ROUTED:3",
                                superseded=prefill_delivery)
    assert handed.outcome is TakeOver.CONTINUE and handed.migrations == 0
    again = await ask_progress(nc, request_id, NEW_WORKER_ID + 1, delivery=prefill_delivery)
    assert again.outcome is TakeOver.CLOSED and again.migrations == 0
    # A delivery the handoff did not replace (the decode worker's own, redelivered when it dies) is taken over.
    lost = await ask_progress(nc, request_id, NEW_WORKER_ID + 2, delivery="ROUTED:3")
    assert lost.outcome is TakeOver.CONTINUE and lost.migrations == 1
    await nc.publish(subjects.CANCEL, Cancel(request_id=request_id, reason="client_disconnected").to_bytes())


async def test_a_handoff_asked_after_its_replaced_delivery_was_taken_over_is_closed(
    nc: Client, tokenizer: Tokenizer
) -> None:
    """The other order: the prefill worker's delivery came back to another worker, which asked first and took the
    request over. The decode worker the handoff reached is told the request is closed, so that one worker runs it,
    and the take-over stays the only migration."""
    request_id = await streaming(nc, tokenizer)
    prefill_delivery = "SPECMESH_REQUESTS:8"
    taken = await ask_progress(nc, request_id, NEW_WORKER_ID + 1, delivery=prefill_delivery)
    assert taken.outcome is TakeOver.CONTINUE and taken.migrations == 1
    handed = await ask_progress(nc, request_id, NEW_WORKER_ID, handoff_from=WORKER_ID, delivery="ROUTED:4",
                                superseded=prefill_delivery)
    assert handed.outcome is TakeOver.CLOSED and handed.migrations == 1
    # The worker that took the delivery over, a prefill worker, hands the request on itself: that handoff is its own.
    handed_on = await ask_progress(nc, request_id, NEW_WORKER_ID + 2, handoff_from=NEW_WORKER_ID + 1,
                                   delivery="ROUTED:5", superseded=prefill_delivery)
    assert handed_on.outcome is TakeOver.CONTINUE and handed_on.migrations == 1
    await nc.publish(subjects.CANCEL, Cancel(request_id=request_id, reason="client_disconnected").to_bytes())


async def test_a_second_handoff_of_one_delivery_is_closed_and_the_first_one_come_back_is_taken_over(
    nc: Client, tokenizer: Tokenizer
) -> None:
    """A routed publish whose answer was lost after JetStream stored it, sent again to another decode worker: two
    handoffs replace one delivery, and only the first runs the request. Its own message come back (its decode worker
    died or gave up asking) is taken over, not closed: nothing else runs the request then."""
    request_id = await streaming(nc, tokenizer)
    prefill_delivery = "SPECMESH_REQUESTS:11"
    first = await ask_progress(nc, request_id, NEW_WORKER_ID, handoff_from=WORKER_ID, delivery="ROUTED:1",
                               superseded=prefill_delivery)
    assert first.outcome is TakeOver.CONTINUE and first.migrations == 0
    second = await ask_progress(nc, request_id, NEW_WORKER_ID + 1, handoff_from=WORKER_ID, delivery="ROUTED:2",
                                superseded=prefill_delivery)
    assert second.outcome is TakeOver.CLOSED and second.migrations == 0
    again = await ask_progress(nc, request_id, NEW_WORKER_ID + 2, handoff_from=WORKER_ID, delivery="ROUTED:1",
                               superseded=prefill_delivery)
    assert again.outcome is TakeOver.CONTINUE and again.migrations == 1
    await nc.publish(subjects.CANCEL, Cancel(request_id=request_id, reason="client_disconnected").to_bytes())


async def test_a_gateway_learns_which_requests_are_held(nc: Client) -> None:
    held, _ = await open_request(nc, api="completion")
    gone = "0" * 32
    query = HeldQuery(request_ids=(held, gone))
    reply = await nc.request(subjects.held(DETOK_ID), query.to_bytes(), timeout=RECEIVE_TIMEOUT_S)
    assert HeldReport.from_bytes(reply.data).request_ids == (held,)
    await nc.publish(subjects.CANCEL, Cancel(request_id=held, reason="client_disconnected").to_bytes())


@pytest.mark.parametrize("raw", [b"{}", b"not json"])
async def test_malformed_queries_are_counted_and_unanswered(nc: Client, raw: bytes) -> None:
    label = subjects.progress(DETOK_ID)
    before = counter("specmesh_detokenizer_bad_messages_total", subject=label)
    await nc.publish(label, raw)
    await barrier(nc)
    await asyncio.sleep(SILENCE_S)
    assert counter("specmesh_detokenizer_bad_messages_total", subject=label) == before + 1


async def test_only_unfinished_choices_are_taken_over(nc: Client, tokenizer: Tokenizer) -> None:
    request_id, chunks = await open_request(nc, api="completion", n=2)
    await barrier(nc)
    done, going = tokenizer.encode("x = 1", add_special_tokens=False), tokenizer.encode("y", add_special_tokens=False)
    await publish_target(nc, WORKER_ID, 1, request_id, done, seq_no=0, offset=0, choice=0, finish=FinishReason.LENGTH)
    await publish_target(nc, WORKER_ID, 1, request_id, going, seq_no=0, offset=0, choice=1)
    for _ in range(2):
        await next_chunk(chunks)
    report = await ask_progress(nc, request_id, NEW_WORKER_ID)
    assert report.progress == (ChoiceProgress(index=1, output_token_ids=tuple(going), next_seq_no=1),)
    await publish_target(nc, NEW_WORKER_ID, 1, request_id, going, seq_no=1, offset=len(going), choice=1,
                         finish=FinishReason.LENGTH)
    (chunk,) = await until_final(chunks)
    assert chunk.choice["index"] == 1 and chunk.usage.completion_tokens == len(done) + 2 * len(going)
