"""Background responses across gateways (services/gateway/responses/background.py), on a real NATS server with the
gateway's user and permissions and the response bucket: a cancel reaches the gateway running the response from any
other, one nobody runs is cancelled in the store unless it ended meanwhile, a last state too large for the store is
kept as a failure saying so, and a stopping gateway fails its runs."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any

import aiohttp

from services.gateway.responses.output import ResponseOutput
from services.gateway.responses.background import STOPPED, BackgroundRun, BackgroundRuns
from services.gateway.responses.store import STALE_AFTER_S, ResponseStore, StoredRecord
from services.gateway.limits import GatewayLimits
from shared.config import DEFAULT_MODEL_DIR
from shared.nats_roles import NatsRole
from tests.gatewayfixture import MODEL, start_gateway
from tests.partsfixture import Service
from tests.natsfixture import NatsServer, nats_server

__all__ = ["nats_server"]  # a fixture, imported for pytest to find


def _output(response_id: str) -> ResponseOutput:
    output = ResponseOutput(response_id, int(time.time()), {"background": True})
    output.status = "queued"
    return output


def _queued(response_id: str) -> StoredRecord:
    return StoredRecord(_output(response_id).snapshot(), [{"role": "user", "content": "hi"}], [],
                        heartbeat=time.time())


def _validated() -> asyncio.Event:
    validated = asyncio.Event()
    validated.set()
    return validated


async def _started(
    runs: BackgroundRuns, store: ResponseStore, response_id: str, serve: Coroutine[Any, Any, Any] | None = None
) -> asyncio.Task:
    """A run of `serve` (by default one that waits until it is stopped), its entry written queued."""
    output = _output(response_id)
    run = BackgroundRun(store, StoredRecord(output.snapshot(), [], [], heartbeat=time.time()))
    await run.write(run.record.response)
    return runs.run(run, serve or asyncio.sleep(3600), lambda: output, _validated(), lambda exc: exc)


async def test_a_cancel_reaches_the_gateway_running_the_response(nats_server: NatsServer) -> None:
    running, other = [await nats_server.connect_as(NatsRole.GATEWAY) for _ in range(2)]
    try:
        here, there = BackgroundRuns(running, ResponseStore(running)), BackgroundRuns(other, ResponseStore(other))
        await here.start()
        await there.start()
        task = await _started(here, ResponseStore(running), "resp_far")
        cancelled = await there.cancel("resp_far")  # asked at the other gateway
        assert cancelled.response["status"] == "cancelled" and task.cancelled()
        # A response whose gateway is gone (stored running, nobody runs it): cancelled in the store
        store = ResponseStore(other)
        await store.keep(_queued("resp_orphan"))
        assert (await there.cancel("resp_orphan")).response["status"] == "cancelled"
        # ... unless its entry changed since it was read: a run that ended meanwhile keeps its end
        await store.keep(_queued("resp_ended"))
        record, revision = await store.get_entry("resp_ended")
        await store.keep(StoredRecord({**record.response, "status": "completed"}, record.turn, record.items))
        cancelled_late = StoredRecord({**record.response, "status": "cancelled"}, record.turn, record.items)
        assert not await store.replace(cancelled_late, revision)
        assert (await there.cancel("resp_ended")).response["status"] == "completed"
    finally:
        await running.close()
        await other.close()


async def test_a_run_whose_reply_lands_with_the_cancel_is_cancelled_all_the_same(nats_server: NatsServer) -> None:
    """Python 3.11's asyncio.wait_for (under every nats-py request) returns a reply that arrived in the step the
    cancellation landed in, and drops the cancellation: the run, a queued response asking its detokenizer whether it
    still holds the request, would wait for its chunks for ten minutes, and the cancel with it."""
    nc = await nats_server.connect_as(NatsRole.GATEWAY)
    try:
        store, reply = ResponseStore(nc), asyncio.get_running_loop().create_future()
        runs = BackgroundRuns(nc, store)
        asked = asyncio.Event()

        async def queued_response() -> None:
            asked.set()
            await asyncio.wait_for(reply, timeout=60)  # as nats-py's request waits for its reply
            await asyncio.sleep(3600)  # the chunks of a request no worker takes

        task = await _started(runs, store, "resp_reply", queued_response())
        await asyncio.wait_for(asked.wait(), 5)
        reply.set_result(b"held")  # in the same step as the cancel: before the waiter is resumed
        cancelled = await asyncio.wait_for(runs.cancel("resp_reply"), 10)
        assert cancelled.response["status"] == "cancelled" and task.done()
    finally:
        await nc.close()


async def test_a_last_state_the_store_cannot_hold_is_kept_as_a_failure(nats_server: NatsServer) -> None:
    nc = await nats_server.connect_as(NatsRole.GATEWAY)
    try:
        store = ResponseStore(nc)
        run = BackgroundRun(store, _queued("resp_huge"))
        huge = {**run.record.response, "status": "completed", "output": [{"text": "x" * nc.max_payload}]}
        assert not await run.write(huge, final=True)
        kept = (await store.get("resp_huge")).response
        assert kept["status"] == "failed" and kept["output"] == [] and "too large" in kept["error"]["message"]
        # An input over the store's size too: kept without it
        long_input = [{"role": "user", "content": "x" * nc.max_payload}]
        run = BackgroundRun(store, StoredRecord(_queued("resp_long").response, long_input, []))
        assert await run.write(run.record.response, first=True) is False  # the queued entry: not kept
        assert not await run.write({**run.record.response, "status": "completed"}, final=True)
        kept = await store.get("resp_long")
        assert kept.response["status"] == "failed" and kept.turn == []
    finally:
        await nc.close()


async def test_a_stopping_gateway_fails_its_runs_saying_so(nats_server: NatsServer) -> None:
    nc = await nats_server.connect_as(NatsRole.GATEWAY)
    try:
        store = ResponseStore(nc)
        runs = BackgroundRuns(nc, store)
        await _started(runs, store, "resp_stopped")
        await runs.stop()
        kept = (await store.get("resp_stopped")).response
        assert kept["status"] == "failed" and kept["error"] == STOPPED
    finally:
        await nc.close()



async def test_a_response_whose_gateway_died_reads_and_continues_as_failed(nats_server: NatsServer) -> None:
    """Its entry stopped being written: readers, a cancel (which writes what they see) and a continuation take it as
    failed, never as running for ever."""
    nc = await nats_server.connect_as(NatsRole.GATEWAY)
    try:
        store = ResponseStore(nc)
        dead = _queued("resp_dead")
        running = {**dead.response, "status": "in_progress", "output": []}
        await store.keep(StoredRecord(running, dead.turn, [], heartbeat=time.time() - 2 * STALE_AFTER_S))
        assert (await store.history("resp_dead"))[0] == dead.turn[0]  # continued: no 400 for a run that cannot end
        runs = BackgroundRuns(nc, store)
        assert (await runs.cancel("resp_dead")).response["status"] == "failed"
        assert (await store.get("resp_dead")).response["status"] == "failed"  # written, as readers saw it
    finally:
        await nc.close()


async def test_a_client_over_its_bound_hears_its_429_and_nothing_is_stored(nats_server: NatsServer) -> None:
    """A background request is answered once counted against its client's bound, as the foreground one is: the
    second at once of a client allowed one is a 429, not a `failed` entry. A gateway and a detokenizer with no worker
    behind them, so the first stays queued."""
    detokenizer = await asyncio.to_thread(Service, "detokenizer", nats_server)
    server, nc = await start_gateway(nats_server, DEFAULT_MODEL_DIR, limits=GatewayLimits(max_concurrent_per_key=1))
    try:
        body = {"model": MODEL, "input": "hi", "max_output_tokens": 4, "background": True}
        async with aiohttp.ClientSession() as session:
            async with session.post(server.make_url("/v1/responses"), json=body) as first:
                queued = await first.json()
            assert first.status == 200 and queued["status"] == "queued"
            async with session.post(server.make_url("/v1/responses"), json=body) as second:
                refused = await second.json()
            assert second.status == 429 and refused["error"]["code"] == "rate_limit_exceeded"
            async with session.post(server.make_url(f"/v1/responses/{queued['id']}/cancel")) as cancelled:
                assert (await cancelled.json())["status"] == "cancelled"
    finally:
        await server.close()
        await nc.drain()
        detokenizer.kill()
