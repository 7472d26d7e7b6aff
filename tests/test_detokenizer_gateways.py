"""A gateway that dies leaves no request running for nobody: the detokenizer asks the gateways its open requests'
chunks go to which they still wait for (services/detokenizer/gateways.py), and closes and stops at the workers
those of a gateway gone and those a gateway no longer waits for; a gateway that does not answer in time decides
nothing. The real service on a real nats-server, the test playing the gateways and a worker."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from nats.aio.client import Client
from prometheus_client import REGISTRY

from services.detokenizer import gateways
from shared import subjects
from shared.frames import FrameBuilder, FrameKind
from shared.nats_roles import NatsRole
from shared.natsutil import barrier, connect
from shared.schemas import Cancel, DetokOpen, DetokReady, HeldQuery, HeldReport
from tests.detokfixture import detokenizer_service, until_it_answers
from tests.natsfixture import NatsServer, nats_server
from tests.test_detokenizer_reaper import model_dir

__all__ = ["model_dir", "nats_server"]  # fixtures, imported for pytest to find

CHECK_INTERVAL_S = 0.2
WAIT_S = 5.0
DETOK_ID = "detok-gateways"
ABANDONED = "specmesh_detokenizer_abandoned_requests_total"
LIVE, GONE, SLOW = "live", "gone", "slow"  # gateway ids


class Gateways:
    """The test's side: gateways that open requests and answer (or not) which they still wait for, and a worker."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.held: set[str] = set()  # what the live gateway waits for
        self.stops: asyncio.Queue[Cancel] = asyncio.Queue()
        self.step = 0

    async def start(self) -> None:
        async def stopped(msg) -> None:
            await self.stops.put(Cancel.from_bytes(msg.data))

        async def live(msg) -> None:
            query = HeldQuery.from_bytes(msg.data)
            await msg.respond(HeldReport(request_ids=tuple(r for r in query.request_ids if r in self.held)).to_bytes())

        async def slow(msg) -> None:
            await asyncio.sleep(2 * gateways.ANSWER_TIMEOUT_S)

        await self.nc.subscribe(subjects.STOP, cb=stopped)
        await self.nc.subscribe(subjects.gateway_held(LIVE), cb=live)
        await self.nc.subscribe(subjects.gateway_held(SLOW), cb=slow)
        await barrier(self.nc)

    async def open(self, gateway_id: str, request_id: str | None = None) -> str:
        request_id = request_id or uuid.uuid4().hex
        opening = DetokOpen(request_id=request_id, reply_subject=subjects.responses(gateway_id), api="completion",
                            num_prompt_tokens=1)
        reply = await self.nc.request(subjects.DETOK_OPEN, opening.to_bytes(), timeout=WAIT_S)
        assert DetokReady.from_bytes(reply.data).detok_id == DETOK_ID
        return request_id

    async def frame(self, request_id: str, seq_no: int) -> None:
        """A worker's TARGET record of one token, the request still running."""
        self.step += 1
        builder = FrameBuilder(FrameKind.TARGET, worker_id=1, step=self.step, top_k=0)
        builder.add(request_id, seq_no=seq_no, offset=seq_no, token_ids=np.array([[7]]),
                    logprobs=np.zeros((1, 1)), ranks=np.ones(1))
        await self.nc.publish(subjects.frames(DETOK_ID), builder.encode())

    def stopped(self) -> dict[str, Cancel]:
        """The stops published since the last call, by request id."""
        cancels = {}
        while not self.stops.empty():
            cancel = self.stops.get_nowait()
            cancels[cancel.request_id] = cancel
        return cancels


@pytest.fixture(scope="module")
async def mesh(nats_server: NatsServer, model_dir: Path) -> AsyncIterator[Gateways]:  # noqa: F811
    options = ("--gateway-check-interval", str(CHECK_INTERVAL_S))
    async with detokenizer_service(nats_server, model_dir, DETOK_ID, *options):
        nc = await connect(nats_server.settings(NatsRole.ADMIN), "test-gateways")
        mesh = Gateways(nc)
        await mesh.start()

        async def open_live() -> None:
            mesh.held.add(await mesh.open(LIVE))

        await until_it_answers(open_live)
        yield mesh
        await nc.drain()


async def test_the_requests_of_a_gateway_gone_are_stopped_at_the_workers(mesh: Gateways) -> None:
    before = REGISTRY.get_sample_value(ABANDONED) or 0.0
    orphans = {await mesh.open(GONE) for _ in range(3)}
    stopped: set[str] = set()
    for seq_no in range(int(WAIT_S / CHECK_INTERVAL_S)):
        for request_id in orphans - stopped:  # their worker still sends frames: only the check ends them
            await mesh.frame(request_id, seq_no)
        await asyncio.sleep(CHECK_INTERVAL_S / 2)
        stopped |= set(mesh.stopped())
        if orphans <= stopped:
            break
    assert orphans <= stopped
    assert REGISTRY.get_sample_value(ABANDONED) >= before + len(orphans)


async def test_a_live_gateway_keeps_what_it_waits_for_and_loses_what_it_does_not(mesh: Gateways) -> None:
    kept = uuid.uuid4().hex
    mesh.held.add(kept)  # before it opens, as a gateway registers a request before it sends anything
    await mesh.open(LIVE, kept)
    dropped = await mesh.open(LIVE)  # one whose Cancel was lost: the gateway forgot it
    await asyncio.sleep(4 * CHECK_INTERVAL_S)
    stopped = mesh.stopped()
    assert stopped.get(dropped) == Cancel(request_id=dropped, reason="client_disconnected")
    assert kept not in stopped


async def test_one_check_nobody_answers_decides_nothing(nats_server: NatsServer) -> None:  # noqa: F811
    """A gateway reconnecting to NATS is briefly not subscribed: it is gone only when unanswered twice in a row, and
    not at all while the detokenizer itself has just reconnected."""
    nc = await connect(nats_server.settings(NatsRole.DETOKENIZER), "test-checks")
    try:
        checks = gateways.GatewayChecks(nc)
        orphan = [(uuid.uuid4().hex, subjects.responses("vanished"))]
        assert await checks.abandoned(orphan) == []
        assert await checks.abandoned(orphan) == [orphan[0][0]]
        assert await checks.abandoned(orphan, judge_silence=False) == []
        assert await checks.abandoned(orphan) == []  # the count starts over after a reconnect's grace
    finally:
        await nc.drain()


async def test_a_gateway_that_does_not_answer_in_time_decides_nothing(mesh: Gateways) -> None:
    waiting = await mesh.open(SLOW)
    await asyncio.sleep(gateways.ANSWER_TIMEOUT_S + 3 * CHECK_INTERVAL_S)
    assert waiting not in mesh.stopped()


def test_a_gateway_is_known_by_the_subject_its_chunks_go_to() -> None:
    assert gateways.gateway_of(subjects.responses("a1b2")) == "a1b2"
    assert gateways.gateway_of("elsewhere.responses.a1b2") is None
    assert gateways.gateway_of(subjects.responses("a1b2") + ".more") is None
    assert gateways.gateway_of(subjects.responses("")) is None


async def test_with_the_check_off_a_gateway_nobody_answers_for_keeps_its_requests(
    nats_server: NatsServer, model_dir: Path  # noqa: F811
) -> None:
    """--gateway-check-interval 0, while gateways from before the check (which answer nothing) still run."""
    async with detokenizer_service(nats_server, model_dir, DETOK_ID + "-off", "--gateway-check-interval", "0"):
        nc = await connect(nats_server.settings(NatsRole.ADMIN), "test-check-off")
        try:
            stops: asyncio.Queue[Cancel] = asyncio.Queue()

            async def stopped(msg) -> None:
                await stops.put(Cancel.from_bytes(msg.data))

            await nc.subscribe(subjects.STOP, cb=stopped)
            opening = DetokOpen(request_id=uuid.uuid4().hex, reply_subject=subjects.responses(GONE), api="completion",
                                num_prompt_tokens=1)

            async def open_one() -> None:
                await nc.request(subjects.DETOK_OPEN, opening.to_bytes(), timeout=WAIT_S)

            await until_it_answers(open_one)
            await asyncio.sleep(5 * CHECK_INTERVAL_S)  # what the checked service takes to stop it
            assert stops.empty()
        finally:
            await nc.drain()
