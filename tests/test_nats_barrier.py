"""natsutil.barrier: once it returns, the server has read what the connection sent before it.

nats-py's own flush() writes its PING ahead of a SUB still in the client's buffer, so a request from another
connection right after it could find no responders (seen under load in the KV transport's tests). A proxy between
the client and a real server records the bytes in the order the server reads them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from shared.nats_roles import NatsRole
from shared.nats_settings import NatsSettings
from shared.natsutil import barrier, connect
from tests.natsfixture import HOST, NatsServer, nats_server  # noqa: F401  (the fixture is used by name)

SUBJECT = "specmesh.kv.2"
PING = b"PING\r\n"


async def ignore(msg: object) -> None:
    pass


class Recorder:
    """A TCP proxy to the server that keeps every byte its clients sent, in the order they were forwarded."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sent = bytearray()
        self.server: asyncio.Server | None = None

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, record: bool) -> None:
        while data := await reader.read(65536):
            if record:
                self.sent += data
            writer.write(data)
            await writer.drain()
        writer.close()

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        server_reader, server_writer = await asyncio.open_connection(HOST, self.port)
        await asyncio.gather(
            self._pipe(client_reader, server_writer, record=True),
            self._pipe(server_reader, client_writer, record=False),
            return_exceptions=True,
        )

    async def __aenter__(self) -> int:
        self.server = await asyncio.start_server(self._accept, HOST, 0)
        return self.server.sockets[0].getsockname()[1]

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()


@pytest.fixture
async def recorded(nats_server: NatsServer) -> AsyncIterator[tuple[Recorder, NatsSettings]]:  # noqa: F811
    recorder = Recorder(nats_server.port)
    async with recorder as port:
        settings = nats_server.settings(NatsRole.WORKER)
        yield recorder, NatsSettings(url=f"nats://{HOST}:{port}", role=settings.role, credentials=settings.credentials)


async def test_a_subscription_reaches_the_server_before_the_barrier_returns(recorded) -> None:
    recorder, settings = recorded
    nc = await connect(settings, "barrier-test")
    try:
        await nc.subscribe(SUBJECT, cb=ignore)
        await barrier(nc)
        sub = recorder.sent.find(f"SUB {SUBJECT}".encode())
        assert sub >= 0, "the subscription never left the client"
        # The server answers PINGs in the order it reads them: a PING read after the SUB means the PONG the barrier
        # waited for came once the subscription was registered.
        assert recorder.sent.find(PING, sub) > sub, f"no PING after the SUB: {bytes(recorder.sent[sub:])!r}"
    finally:
        await nc.close()


async def test_a_caller_cancelled_while_it_waits_leaves_the_connection_reading(nats_server: NatsServer) -> None:
    """nats-py resolves a flush's PONG future even after its waiter was cancelled, and the InvalidStateError that
    raises stops the connection's read loop: every later request would time out. A barrier cancelled while its PING
    is out (an HTTP client leaving a stream as it starts) must not do that."""
    nc = await nats_server.connect_as(NatsRole.GATEWAY)
    try:
        for _ in range(3):
            waiting = asyncio.create_task(barrier(nc))
            while not nc._pongs:  # its PING is out and its PONG awaited
                await asyncio.sleep(0)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
        await asyncio.sleep(0.2)  # the PONGs arrive
        assert not nc._reading_task.done()
        await asyncio.wait_for(nc.flush(), 2)  # the connection still hears its server
    finally:
        await nc.close()
