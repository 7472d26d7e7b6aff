"""A background response is cancelled from any gateway (services/gateway/responses/background.py): the gateway
running it answers on NATS, and one whose runner is gone is cancelled in the store. Real NATS (the gateway's user and
permissions, the response bucket), two gateways' BackgroundRuns, a run that waits until it is cancelled."""

from __future__ import annotations

import asyncio
import time

from services.gateway.responses.background import BackgroundRun, BackgroundRuns, run_detached
from services.gateway.responses.store import ResponseStore, StoredRecord
from shared.nats_roles import NatsRole
from tests.natsfixture import NatsServer, nats_server

__all__ = ["nats_server"]  # a fixture, imported for pytest to find


def _queued(response_id: str) -> StoredRecord:
    response = {"id": response_id, "object": "response", "status": "queued", "background": True, "error": None,
                "output": [], "usage": None}
    return StoredRecord(response, [{"role": "user", "content": "hi"}], [])


async def test_a_cancel_reaches_the_gateway_running_the_response(nats_server: NatsServer) -> None:
    running, other = [await nats_server.connect_as(NatsRole.GATEWAY) for _ in range(2)]
    try:
        here, there = BackgroundRuns(running, ResponseStore(running)), BackgroundRuns(other, ResponseStore(other))
        await here.start()
        await there.start()
        run = BackgroundRun(ResponseStore(running), _queued("resp_far"))
        validated = asyncio.Event()
        validated.set()
        await run.write(run.record.response)
        task = here.run("resp_far", run_detached(run, asyncio.sleep(3600), lambda: None, validated))
        cancelled = await there.cancel("resp_far")  # asked at the other gateway
        assert cancelled.response["status"] == "cancelled" and task.cancelled()
        # A response whose gateway is gone (stored running, nobody runs it): cancelled in the store
        await ResponseStore(other).keep(StoredRecord(_queued("resp_orphan").response, [], [], heartbeat=time.time()))
        assert (await there.cancel("resp_orphan")).response["status"] == "cancelled"
    finally:
        await running.close()
        await other.close()
