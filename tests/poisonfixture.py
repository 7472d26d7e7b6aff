"""A mesh of real processes for the poison-request tests: NATS (restartable on the same store, port and credentials),
a detokenizer, a gateway and a worker serving the demo model; and helpers that publish onto the mesh with the
gateway's NATS credentials, as anyone holding them could.

Import the fixture into a test module (`from tests.poisonfixture import poison_mesh`).
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from shared import subjects
from shared.nats_roles import NatsRole
from shared.natsutil import connect
from shared.schemas import Chunk, DetokOpen, DetokReady
from tests.natsfixture import NatsServer, running_nats_server, wait_for_everything
from tests.partsfixture import Parts, Service
from tests.test_e2e import CODE_PROMPT, E2E_MODEL

CLIENT_TIMEOUT_S = 60.0  # a request the mesh dropped fails the test in a minute, not the gateway's ten
CHUNK_TIMEOUT_S = 30.0
DRAIN_TIMEOUT_S = 30.0


class PoisonMesh:
    """Parts (tests/partsfixture.py) with one worker, and a NATS server that can be restarted on its store."""

    def __init__(self, store_dir: Path) -> None:
        self.store_dir = store_dir
        self._nats = ExitStack()
        self.nats = self._nats.enter_context(running_nats_server(store_dir))
        self.parts = Parts(self.nats)
        self.worker = self.parts.start("worker")
        self.client = self.parts.client.with_options(timeout=CLIENT_TIMEOUT_S)

    def restart_nats(self) -> None:
        """Stops nats-server and starts it again on the same store, port and credentials; services reconnect."""
        port, credentials = self.nats.port, self.nats.credentials
        self._nats.close()
        self._nats = ExitStack()
        self.nats = self._nats.enter_context(running_nats_server(self.store_dir, port, credentials))

    def restart_worker(self) -> Service:
        assert self.worker.terminate() == 0
        self.worker = self.parts.start("worker")
        return self.worker

    def serves(self) -> None:
        """A normal request gets its tokens."""
        r = self.client.completions.create(model=E2E_MODEL.name, prompt=CODE_PROMPT, max_tokens=4, temperature=0)
        assert r.choices[0].text and r.usage.completion_tokens > 0

    def alive(self) -> bool:
        """Whether the detokenizer, the gateway and the current worker still run."""
        return all(s.proc.poll() is None for s in (self.parts.detokenizer, self.parts.gateway, self.worker))

    def close(self) -> None:
        for service in self.parts.started:
            service.kill()
        self._nats.close()


@pytest.fixture(scope="module")
def poison_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoisonMesh]:
    mesh = PoisonMesh(tmp_path_factory.mktemp("nats"))
    yield mesh
    mesh.close()


def rss_bytes(service: Service) -> int:
    """The process's resident memory."""
    status = Path(f"/proc/{service.proc.pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB$", status, re.M).group(1)) * 1024


async def as_role(nats: NatsServer, role: NatsRole):
    """A NATS connection with the role's credentials: the gateway's to forge requests, a worker's to take them,
    the admin's to look into the streams."""
    return await connect(nats.settings(role), f"test-{role}-{uuid.uuid4().hex[:8]}")


async def open_at_detokenizer(nc, request_id: str, num_prompt_tokens: int):
    """Opens a request at a detokenizer as the gateway does; (its detokenizer id, the subscription its chunks
    arrive on)."""
    gateway_id = uuid.uuid4().hex[:12]
    reply_subject = subjects.responses(gateway_id)
    await wait_for_everything(nc, gateway_id)
    chunks = await nc.subscribe(reply_subject)
    opening = DetokOpen(
        request_id=request_id, reply_subject=reply_subject, api="completion", num_prompt_tokens=num_prompt_tokens
    )
    reply = await nc.request(subjects.DETOK_OPEN, opening.to_bytes(), timeout=CHUNK_TIMEOUT_S)
    return DetokReady.from_bytes(reply.data).detok_id, chunks


async def final_chunk(chunks) -> Chunk:
    deadline = time.monotonic() + CHUNK_TIMEOUT_S
    while True:
        chunk = Chunk.from_bytes((await chunks.next_msg(timeout=max(0.1, deadline - time.monotonic()))).data)
        if chunk.final:
            return chunk


async def until_queue_empty(admin) -> None:
    """Waits until the work queue holds nothing: every message was acknowledged or terminated."""
    js = admin.jetstream()
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while (await js.stream_info(subjects.REQUEST_STREAM)).state.messages:
        assert time.monotonic() < deadline, "the work queue kept messages nobody finished"
        await asyncio.sleep(0.1)
