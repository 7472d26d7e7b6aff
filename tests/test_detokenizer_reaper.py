"""The detokenizer lets go of requests nobody will finish: silent ones after its idle timeout, and ones whose
Cancel overtook their opening. The real service on a real nats-server, the test playing gateway and worker."""

from __future__ import annotations

import asyncio
import sysconfig
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from nats.aio.client import Client
from prometheus_client import REGISTRY

from shared import subjects
from shared.frames import FrameBuilder, FrameKind
from shared.nats_roles import NatsRole
from shared.natsutil import barrier, connect
from shared.schemas import Cancel, Chunk, DetokOpen, DetokReady
from services.worker.demo_model.tokenizer import train_tokenizer
from tests.detokfixture import detokenizer_service, until_it_answers
from tests.natsfixture import NatsServer, nats_server, wait_for_everything

__all__ = ["nats_server"]  # a fixture, imported for pytest to find

IDLE_TIMEOUT_S = 0.5
WAIT_S = 5.0
DETOK_ID = "detok-reaper"
TOKEN = 7
REAPED = "specmesh_detokenizer_reaped_requests_total"
VOCAB_SIZE = 300
TRAINING_FILES = ("textwrap.py",)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tokenizer")
    stdlib = Path(sysconfig.get_path("stdlib"))
    train_tokenizer([(stdlib / name).read_text() for name in TRAINING_FILES], VOCAB_SIZE, out)
    return out


class Mesh:
    """The test's side: opens requests as a gateway, sends frames as a worker, hears the detokenizer's stops."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.stops: asyncio.Queue[Cancel] = asyncio.Queue()
        self.chunks: asyncio.Queue[Chunk] = asyncio.Queue()
        self.step = 0

    async def start(self) -> None:
        async def stopped(msg) -> None:
            await self.stops.put(Cancel.from_bytes(msg.data))

        async def chunk(msg) -> None:
            await self.chunks.put(Chunk.from_bytes(msg.data))

        await self.nc.subscribe(subjects.STOP, cb=stopped)
        await self.nc.subscribe(subjects.responses("test"), cb=chunk)
        await wait_for_everything(self.nc, "test")

    async def open(self, request_id: str) -> None:
        opening = DetokOpen(request_id=request_id, reply_subject=subjects.responses("test"), api="completion",
                            num_prompt_tokens=1)
        reply = await self.nc.request(subjects.DETOK_OPEN, opening.to_bytes(), timeout=WAIT_S)
        assert DetokReady.from_bytes(reply.data).detok_id == DETOK_ID

    async def frame(self, request_id: str, seq_no: int) -> None:
        """One TARGET record of one token, the request still running."""
        self.step += 1
        builder = FrameBuilder(FrameKind.TARGET, worker_id=1, step=self.step, top_k=0)
        builder.add(request_id, seq_no=seq_no, offset=seq_no, token_ids=np.array([[TOKEN]]),
                    logprobs=np.zeros((1, 1)), ranks=np.ones(1))
        await self.nc.publish(subjects.frames(DETOK_ID), builder.encode())


@pytest.fixture(scope="module")
async def mesh(nats_server: NatsServer, model_dir: Path) -> AsyncIterator[Mesh]:  # noqa: F811
    async with detokenizer_service(nats_server, model_dir, DETOK_ID, "--idle-request-timeout", str(IDLE_TIMEOUT_S)):
        nc = await connect(nats_server.settings(NatsRole.ADMIN), "test-mesh")  # it plays gateway and worker
        mesh = Mesh(nc)
        await mesh.start()
        await until_it_answers(lambda: mesh.open(uuid.uuid4().hex))
        yield mesh
        await nc.drain()


async def _stop_of(mesh: Mesh, request_id: str) -> Cancel:
    while (stop := await asyncio.wait_for(mesh.stops.get(), WAIT_S)).request_id != request_id:
        pass  # the readiness probe's requests are reaped too
    return stop


async def test_a_silent_request_is_reaped_and_stopped_at_the_workers(mesh: Mesh) -> None:
    reaped = REGISTRY.get_sample_value(REAPED) or 0.0
    request_id = uuid.uuid4().hex
    await mesh.open(request_id)
    assert await _stop_of(mesh, request_id) == Cancel(request_id=request_id, reason="error")
    assert REGISTRY.get_sample_value(REAPED) >= reaped + 1


async def test_frames_keep_a_request_open(mesh: Mesh) -> None:
    request_id = uuid.uuid4().hex
    await mesh.open(request_id)
    _drain(mesh.chunks)
    for seq_no in range(int(3 * IDLE_TIMEOUT_S / (IDLE_TIMEOUT_S / 4))):  # three timeouts' worth of steps
        await mesh.frame(request_id, seq_no)
        await asyncio.sleep(IDLE_TIMEOUT_S / 4)
        assert request_id not in [s.request_id for s in _drain(mesh.stops)]
    assert any(c.request_id == request_id for c in _drain(mesh.chunks))  # an open request's frames make chunks
    await _stop_of(mesh, request_id)  # once the frames stop


def _drain(queue: asyncio.Queue) -> list:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


async def test_a_cancel_that_overtakes_the_opening_closes_the_request(mesh: Mesh) -> None:
    request_id = uuid.uuid4().hex
    await mesh.nc.publish(subjects.CANCEL, Cancel(request_id=request_id, reason="client_disconnected").to_bytes())
    await barrier(mesh.nc)
    await asyncio.sleep(0.1)  # the cancel is handled first
    await mesh.open(request_id)
    _drain(mesh.chunks)
    await mesh.frame(request_id, 0)
    await asyncio.sleep(IDLE_TIMEOUT_S / 2)
    assert [c for c in _drain(mesh.chunks) if c.request_id == request_id] == []  # it was never opened
