"""A mesh of real processes for the failure tests: NATS (restartable on its store, port and credentials), two
detokenizers, a gateway and two workers serving the demo model, started side by side; and streams that note when
each chunk arrived, so that a test can measure the stall a `kill -9` causes.

Import the fixture into a test module (`from tests.failoverfixture import failover_mesh`).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from shared import subjects
from shared.nats_roles import NatsRole
from shared.natsutil import barrier, connect
from shared.schemas import WorkRequest
from tests.natsfixture import running_nats_server
from tests.partsfixture import Service
from tests.test_e2e import E2E_MODEL

ENGINE_STALL_S = 4.0  # the workers' --engine-stall-timeout: short, so that a test can wait it out
WORKER_OPTIONS = ("--torch-threads", "1", "--max-num-seqs", "8", "--engine-stall-timeout", str(ENGINE_STALL_S))
CLIENT_TIMEOUT_S = 60.0
ID_PREFIX = "cmpl-"  # a completion's id is this and its request id
DETOKENIZER_IDS = ("detok-a", "detok-b")  # FailoverMesh.detokenizers, in this order


class FailoverMesh:
    """The services by role; `restart_nats` brings NATS back where it was, for the services to reconnect to."""

    def __init__(self, store_dir: Path) -> None:
        self.store_dir = store_dir
        self._nats = ExitStack()
        self.nats = self._nats.enter_context(running_nats_server(store_dir))
        with ThreadPoolExecutor() as pool:  # each waits for its own readiness; workers load the model meanwhile
            started = [
                pool.submit(Service, "worker", self.nats, *WORKER_OPTIONS, "--worker-id", "1"),
                pool.submit(Service, "worker", self.nats, *WORKER_OPTIONS, "--worker-id", "2"),
                *(pool.submit(Service, "detokenizer", self.nats, "--detokenizer-id", d) for d in DETOKENIZER_IDS),
                pool.submit(Service, "gateway", self.nats),
            ]
            self.services = [s.result() for s in started]
        self.workers = self.services[:2]
        self.detokenizers = self.services[2:4]
        self.gateway = self.services[4]
        self.client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{self.gateway.port}/v1", api_key="unused", max_retries=0,
            timeout=CLIENT_TIMEOUT_S,
        )

    def restart_nats(self) -> None:
        port, credentials = self.nats.port, self.nats.credentials
        self._nats.close()
        self._nats = ExitStack()
        self.nats = self._nats.enter_context(running_nats_server(self.store_dir, port, credentials))

    def close(self) -> None:
        for service in self.services:
            service.kill()
        self._nats.close()


@pytest.fixture(scope="module")
def failover_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FailoverMesh]:
    mesh = FailoverMesh(tmp_path_factory.mktemp("nats"))
    yield mesh
    mesh.close()


def kill(pid: int) -> float:
    """`kill -9`; returns when it was sent (monotonic)."""
    os.kill(pid, signal.SIGKILL)
    return time.monotonic()


@dataclass
class Streamed:
    """One streamed completion as its client saw it."""

    params: dict  # the completion's: prompt, max_tokens, ...
    request_id: str = ""
    text: str = ""
    arrivals: list[float] = field(default_factory=list)  # monotonic time of each chunk with text
    error: str | None = None
    ended: float = 0.0

    def longest_silence_after(self, moment: float) -> float:
        """The longest wait for a chunk from `moment` on (chunks already on their way at `moment` arrive just after
        it): from `moment` to the first chunk, between two chunks, or from the last chunk to the stream's end."""
        times = [moment] + [t for t in self.arrivals if t > moment] + [self.ended]
        return max(later - earlier for earlier, later in zip(times, times[1:]))


async def stream(client: openai.AsyncOpenAI, out: Streamed) -> Streamed:
    """Streams the completion `out.params` asks for to its end, noting each chunk's arrival in `out`; an error the
    stream ends with is kept."""
    try:
        async for chunk in await client.completions.create(model=E2E_MODEL.name, stream=True, **out.params):
            out.request_id = chunk.id.removeprefix(ID_PREFIX)
            if chunk.choices and chunk.choices[0].text:
                out.text += chunk.choices[0].text
                out.arrivals.append(time.monotonic())
    except openai.APIError as exc:
        out.error = str(exc)
    out.ended = time.monotonic()
    return out


async def until_streaming(streams: list[Streamed], min_chunks: int, timeout_s: float = CLIENT_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while any(len(s.arrivals) < min_chunks for s in streams):
        assert time.monotonic() < deadline, "the streams did not start"
        await asyncio.sleep(0.02)


class QueuedRequests:
    """The WorkRequests the gateway queues, read off the stream's subject with the admin's credentials: the seed the
    gateway fixed for each."""

    def __init__(self) -> None:
        self.by_id: dict[str, WorkRequest] = {}

    async def watch(self, mesh: FailoverMesh):
        nc = await connect(mesh.nats.settings(NatsRole.ADMIN), "test-admin")
        await nc.subscribe(subjects.REQUESTS, cb=self._on_request)
        await nc.subscribe(subjects.ROUTED_SUBJECTS, cb=self._on_request)  # those sent to the worker holding them
        await barrier(nc)
        return nc

    async def _on_request(self, msg) -> None:
        request = WorkRequest.from_bytes(msg.data)
        self.by_id[request.request_id] = request
