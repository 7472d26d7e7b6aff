"""A real nats-server (with JetStream) on a free port, for tests that talk to NATS.

Use the fixture by importing it into a test module (`from tests.natsfixture import nats_server`), or call
`running_nats_server(store_dir)` directly to control its lifetime (e.g. to restart it on the same port, with the
same credentials). Authentication is on, as in the mesh: connect as a role with `server.settings(role)`.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import nats
import pytest

from shared.nats_credentials import MeshCredentials, credentials_file
from shared.nats_roles import NatsRole
from shared.nats_server import credentials_dir, start_nats_server
from shared.ports import free_port
from shared.nats_settings import NatsSettings
from shared.stream_limits import StreamLimits

HOST = "127.0.0.1"
STOP_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class NatsServer:
    port: int
    store_dir: Path
    process: subprocess.Popen
    credentials: MeshCredentials

    @property
    def url(self) -> str:
        return f"nats://{HOST}:{self.port}"

    def settings(self, role: NatsRole) -> NatsSettings:
        """How a service of this role connects (natsutil.connect)."""
        return NatsSettings(url=self.url, role=role, credentials=self.credentials[role])

    async def connect_as(self, role: NatsRole, **options) -> nats.NATS:
        """A client of this role that does not reconnect: a test sees a refusal or a dropped server at once."""
        settings = self.settings(role)
        return await nats.connect(settings.url, allow_reconnect=False, **settings.connect_options(), **options)

    def credentials_file(self, role: NatsRole) -> Path:
        """The role's --nats-credentials file, for services started as processes."""
        return credentials_file(credentials_dir(self.store_dir), role)


@contextmanager
def running_nats_server(
    store_dir: Path, port: int | None = None, credentials: MeshCredentials | None = None,
    limits: StreamLimits = StreamLimits(),
) -> Iterator[NatsServer]:
    """Starts `nats-server -js` storing JetStream data in `store_dir`, once it accepts connections and its admin
    has declared the mesh's streams with `limits`, as `specmesh up` does; stops it on exit. Without `credentials`,
    new ones are generated."""
    port = port or free_port()
    credentials = credentials or MeshCredentials.generate()
    process = start_nats_server(port, store_dir, credentials, host=HOST, limits=limits)
    try:
        yield NatsServer(port, store_dir, process, credentials)
    finally:
        process.terminate()
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    with running_nats_server(tmp_path_factory.mktemp("nats")) as server:
        yield server


async def wait_for_everything(nc, gateway_id: str) -> None:
    """Answers detokenizers' questions after a test gateway's requests as a gateway that waits for every one of them
    (services/detokenizer/gateways.py stops the requests of a gateway nobody answers for)."""
    from shared import subjects
    from shared.schemas import HeldQuery, HeldReport

    async def answer(msg) -> None:
        await msg.respond(HeldReport(request_ids=HeldQuery.from_bytes(msg.data).request_ids).to_bytes())

    await nc.subscribe(subjects.gateway_held(gateway_id), cb=answer)
