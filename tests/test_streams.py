"""The mesh's streams are the admin's to declare (shared/streams.py), on a real nats-server: services wait for them,
a second declaration brings an existing stream to the limits given, and `specmesh streams` does it for a server of
one's own, refusing by name when its credentials are not the admin's."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from nats.js.api import DiscardPolicy

from services import cli, launcher
from shared import streams, subjects
from shared.nats_roles import NatsRole
from shared.ports import free_port
from shared.stream_limits import StreamLimits
from tests.gatewayfixture import model_dir, start_gateway  # noqa: F401  (a fixture is used by name)
from tests.natsfixture import NatsServer, running_nats_server

WAIT_S = 5.0
NOT_YET_S = 3 * streams.WAIT_POLL_S
LIMITS = StreamLimits(max_msgs=7, max_bytes=1 << 20, max_age_s=60.0, response_store_max_age_s=120.0,
                     response_store_max_bytes=1 << 21)
ALL_STREAMS = (subjects.REQUEST_STREAM, subjects.ROUTED_STREAM, subjects.DEAD_LETTER_STREAM)


@pytest.fixture
def nats_server_with_defaults(tmp_path: Path) -> Iterator[NatsServer]:
    with running_nats_server(tmp_path / "nats") as server:
        yield server


async def test_a_service_waits_for_the_streams_and_starts_once_they_are_declared(tmp_path: Path) -> None:
    with running_nats_server(tmp_path / "nats") as server:
        admin, worker = await server.connect_as(NatsRole.ADMIN), await server.connect_as(NatsRole.WORKER)
        try:
            for name in ALL_STREAMS:  # a server of one's own, before anyone declared the streams
                await admin.jetstream().delete_stream(name)
            waiting = asyncio.create_task(streams.wait_for(worker.jetstream(), streams.WORKER_NEEDS, "worker"))
            await asyncio.sleep(NOT_YET_S)
            assert not waiting.done()
            await streams.declare_streams(admin.jetstream())
            await asyncio.wait_for(waiting, WAIT_S)
        finally:
            await worker.close()
            await admin.close()


async def test_declaring_again_sets_the_limits_of_existing_streams(nats_server_with_defaults: NatsServer) -> None:
    admin = await nats_server_with_defaults.connect_as(NatsRole.ADMIN)
    try:
        js = admin.jetstream()
        assert (await js.stream_info(subjects.REQUEST_STREAM)).config.max_msgs == StreamLimits().max_msgs
        await streams.declare_streams(js, LIMITS)
        for name in (subjects.REQUEST_STREAM, subjects.ROUTED_STREAM):
            config = (await js.stream_info(name)).config
            assert (config.max_msgs, config.max_bytes, config.max_age) == (7, 1 << 20, 60.0)
        store = (await js.stream_info(subjects.RESPONSE_STREAM)).config
        assert (store.max_age, store.max_bytes, store.max_msgs_per_subject) == (120.0, 1 << 21, 1)
        events = (await js.stream_info(subjects.RESPONSE_EVENTS_STREAM)).config  # kept as long as the responses
        assert (events.max_age, events.max_bytes, events.discard) == (120.0, 1 << 21, DiscardPolicy.OLD)
        consumer = (await js.consumer_info(subjects.REQUEST_STREAM, subjects.WORKER_CONSUMER)).config
        assert consumer.filter_subject is None  # the shared consumer takes every request subject
    finally:
        await admin.close()


def _specmesh_streams(server: NatsServer, role: NatsRole, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "streams", "--nats-url", server.url,
         "--nats-credentials", str(server.credentials_file(role)), "--wait", "5", *extra],
        capture_output=True, text=True, timeout=60,
    )


async def test_specmesh_streams_declares_as_the_admin_and_names_a_user_that_may_not(
    nats_server_with_defaults: NatsServer,
) -> None:
    server = nats_server_with_defaults
    done = await asyncio.to_thread(_specmesh_streams, server, NatsRole.ADMIN, "--queue-max-msgs", "9")
    assert done.returncode == 0, done.stderr
    refused = await asyncio.to_thread(_specmesh_streams, server, NatsRole.GATEWAY, "--queue-max-msgs", "1")
    assert refused.returncode != 0 and "admin user's credentials" in refused.stderr
    assert "Traceback" not in refused.stderr
    admin = await server.connect_as(NatsRole.ADMIN)
    try:
        assert (await admin.jetstream().stream_info(subjects.REQUEST_STREAM)).config.max_msgs == 9
    finally:
        await admin.close()


async def test_the_requests_an_earlier_run_left_are_dropped(nats_server_with_defaults: NatsServer) -> None:
    """`specmesh up` starting its own server: a request stored by a run killed outright has no client left."""
    server = nats_server_with_defaults
    admin = await server.connect_as(NatsRole.ADMIN)
    try:
        js = admin.jetstream()
        for subject in (subjects.REQUESTS, subjects.REQUESTS, subjects.routed(3)):
            await js.publish(subject, b"left by a killed run")
        dropped = await asyncio.to_thread(
            lambda: streams.OnThread(streams.drop_orphaned_requests(server.settings(NatsRole.ADMIN))).result()
        )
        assert dropped == 3
        for name in (subjects.REQUEST_STREAM, subjects.ROUTED_STREAM):
            assert (await js.stream_info(name)).state.messages == 0
    finally:
        await admin.close()


def test_up_on_a_server_of_ones_own_leaves_the_streams_to_its_admin_when_its_user_may_not(
    nats_server_with_defaults: NatsServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """`specmesh up --nats-url` with a service's credentials: refused at the first answer, said, and the mesh goes on
    (the services wait for the streams), rather than retried until --startup-timeout as if no server were there."""
    server = nats_server_with_defaults
    _, args = cli.parse([
        "up", "--nats-url", server.url, "--nats-credentials", str(server.credentials_file(NatsRole.GATEWAY)),
        "--port", str(free_port()),
    ])
    started = time.monotonic()
    launcher._declare_external_streams(args)
    assert time.monotonic() - started < args.startup_timeout / 10
    assert "may not declare the streams" in capsys.readouterr().err


async def test_a_gateway_waiting_for_the_streams_is_alive_and_not_ready(
    tmp_path: Path, model_dir: Path  # noqa: F811
) -> None:
    """It listens meanwhile: a probe of /health finds it alive (Kubernetes would restart one that did not answer),
    /ready says what it waits for."""
    with running_nats_server(tmp_path / "nats") as server:
        admin = await server.connect_as(NatsRole.ADMIN)
        for name in ALL_STREAMS:
            await admin.jetstream().delete_stream(name)
        gateway, nc = await start_gateway(server, model_dir)
        try:
            async with aiohttp.ClientSession() as http:
                assert (await http.get(gateway.make_url("/health"))).status == 200
                waiting = await http.get(gateway.make_url("/ready"))
                assert waiting.status == 503 and (await waiting.json())["started"] is False
                await streams.declare_streams(admin.jetstream())
                deadline = time.monotonic() + WAIT_S
                while (await http.get(gateway.make_url("/ready"))).status != 200:
                    assert time.monotonic() < deadline, "not ready once the streams exist"
                    await asyncio.sleep(streams.WAIT_POLL_S / 5)
        finally:
            await gateway.close()
            await nc.drain()
            await admin.close()
