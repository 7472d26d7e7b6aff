"""Least privilege on a real nats-server: anonymous clients are refused, each role's user can play its part of the
protocol, and no role can publish or read what belongs to another (shared/nats_roles.py)."""

from __future__ import annotations

import asyncio
import inspect
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import nats
import nats.errors
import pytest
from nats.aio.client import Client
from nats.js.api import AckPolicy, ConsumerConfig
from prometheus_client import REGISTRY

from shared import subjects
from shared.nats_roles import PERMISSIONS, SERVICE_ROLES, NatsRole
from shared import streams
from shared.natsutil import PERMISSIONS_VIOLATION, barrier, core_only
from shared.schemas import Cancel
from tests.natsfixture import NatsServer, nats_server  # noqa: F401  (the fixture is used by name)

WAIT_S = 5.0
REPORT_POLL_S = 0.01
GATEWAY_ID = "gw-under-test"
DETOK_ID = "detok-under-test"
FORGED = b"forged"
FORGING_WORKER = 91  # a routed subject nobody serves
STREAM, CONSUMER = subjects.REQUEST_STREAM, subjects.WORKER_CONSUMER
ROUTED, DEAD_LETTERS = subjects.ROUTED_STREAM, subjects.DEAD_LETTER_STREAM

# (role, subject): messages each role's user must not be able to publish, and why it matters.
FORGERIES = [
    (NatsRole.GATEWAY, subjects.frames(DETOK_ID)),  # text into a client's answer, via the detokenizer
    (NatsRole.GATEWAY, subjects.responses(GATEWAY_ID)),  # a chunk straight to another gateway's client
    (NatsRole.GATEWAY, subjects.STOP),
    (NatsRole.GATEWAY, subjects.RESUMED_REQUESTS),
    (NatsRole.GATEWAY, f"$JS.API.STREAM.DELETE.{STREAM}"),
    (NatsRole.GATEWAY, f"$JS.API.CONSUMER.MSG.NEXT.{STREAM}.{CONSUMER}"),  # taking requests off the queue
    # Declaring streams is the admin's (shared/streams.py): an update could seal the queue or shrink its limits.
    (NatsRole.GATEWAY, f"$JS.API.STREAM.UPDATE.{STREAM}"),
    (NatsRole.GATEWAY, f"$JS.API.STREAM.CREATE.{STREAM}"),
    (NatsRole.GATEWAY, f"$JS.API.STREAM.UPDATE.{ROUTED}"),
    (NatsRole.GATEWAY, f"$JS.API.CONSUMER.CREATE.{STREAM}.{CONSUMER}"),
    (NatsRole.WORKER, subjects.responses(GATEWAY_ID)),  # a chunk on a gateway's reply subject
    (NatsRole.WORKER, "_INBOX.gateway.forged.reply"),  # an answer to the gateway's DetokOpen
    (NatsRole.WORKER, subjects.CANCEL),
    (NatsRole.WORKER, subjects.REQUESTS),
    (NatsRole.WORKER, subjects.DETOK_OPEN),
    (NatsRole.WORKER, f"$JS.API.STREAM.PURGE.{STREAM}"),
    (NatsRole.WORKER, f"$JS.API.STREAM.UPDATE.{STREAM}"),
    (NatsRole.WORKER, f"$JS.API.STREAM.UPDATE.{ROUTED}"),
    (NatsRole.WORKER, f"$JS.API.STREAM.UPDATE.{DEAD_LETTERS}"),
    # Re-filtering or re-timing the consumer every worker shares.
    (NatsRole.WORKER, f"$JS.API.CONSUMER.CREATE.{STREAM}.{CONSUMER}"),
    (NatsRole.WORKER, f"$JS.API.CONSUMER.DURABLE.CREATE.{STREAM}.{CONSUMER}"),
    (NatsRole.WORKER, f"$JS.API.CONSUMER.CREATE.{DEAD_LETTERS}.{subjects.DEAD_LETTER_CONSUMER}"),
    (NatsRole.DETOKENIZER, subjects.CANCEL),  # would close the request at its detokenizer: the client hangs
    (NatsRole.DETOKENIZER, subjects.REQUESTS),
    (NatsRole.DETOKENIZER, subjects.RESUMED_REQUESTS),
    (NatsRole.DETOKENIZER, subjects.DETOK_OPEN),  # "open request" floods that grow other detokenizers
    (NatsRole.DETOKENIZER, subjects.frames(DETOK_ID)),
    (NatsRole.DETOKENIZER, "_INBOX.gateway.forged.reply"),  # only in answer to a request it received
    (NatsRole.DETOKENIZER, f"$JS.API.CONSUMER.MSG.NEXT.{STREAM}.{CONSUMER}"),
    # Stored responses are the gateway's: another role's entry would put words in a conversation's history.
    (NatsRole.WORKER, f"$KV.{subjects.RESPONSE_BUCKET}.resp_forged"),
    (NatsRole.DETOKENIZER, f"$KV.{subjects.RESPONSE_BUCKET}.resp_forged"),
    (NatsRole.GATEWAY, f"$JS.API.STREAM.PURGE.{subjects.RESPONSE_STREAM}"),
    (NatsRole.GATEWAY, f"$JS.API.STREAM.UPDATE.{subjects.RESPONSE_STREAM}"),
]
# (role, subject): what each role's user must not be able to read.
EAVESDROPPING = [
    (NatsRole.GATEWAY, subjects.frames(DETOK_ID)),
    (NatsRole.GATEWAY, subjects.DETOK_OPEN),
    (NatsRole.WORKER, subjects.responses(GATEWAY_ID)),
    (NatsRole.WORKER, subjects.REQUESTS),  # prompts, live: workers get them through the consumer only
    (NatsRole.WORKER, "_INBOX.gateway.>"),
    (NatsRole.DETOKENIZER, subjects.responses(GATEWAY_ID)),
    (NatsRole.DETOKENIZER, subjects.REQUESTS),
    (NatsRole.DETOKENIZER, "_INBOX.worker.>"),
]


class Errors:
    """What nats-py reports through error_cb (`record`) for one connection."""

    def __init__(self) -> None:
        self.reported: list[Exception] = []

    async def record(self, exc: Exception) -> None:
        self.reported.append(exc)

    @property
    def violations(self) -> list[str]:
        return [str(e) for e in self.reported if PERMISSIONS_VIOLATION in str(e).lower()]

    async def first_violations(self) -> list[str]:
        """The violations once one has been reported: nats-py calls error_cb from a task it schedules when the
        server's -ERR arrives, which may run after the flush that follows the refused operation returned."""
        deadline = asyncio.get_running_loop().time() + WAIT_S
        while not self.violations and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(REPORT_POLL_S)
        return self.violations


@pytest.fixture
async def connect(nats_server: NatsServer) -> AsyncIterator[Callable]:  # noqa: F811
    clients: list[Client] = []

    async def connected(role: NatsRole, errors: Errors | None = None) -> Client:
        clients.append(await nats_server.connect_as(role, error_cb=(Errors() if errors is None else errors).record))
        return clients[-1]

    yield connected
    for client in clients:
        await client.close()


async def test_anonymous_and_wrong_password_connections_are_refused(nats_server: NatsServer) -> None:  # noqa: F811
    errors = Errors()
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(nats_server.url, allow_reconnect=False, error_cb=errors.record)
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(
            nats_server.url, allow_reconnect=False, error_cb=errors.record, user="gateway", password="guess"
        )


async def test_each_role_plays_its_part_of_the_protocol(connect: Callable) -> None:
    errors = {role: Errors() for role in SERVICE_ROLES}
    gateway, worker, detok = [await connect(role, errors[role]) for role in SERVICE_ROLES]
    # The admin declared the streams (tests/natsfixture.py, as `specmesh up`); each service may look them up.
    await streams.wait_for(gateway.jetstream(), streams.GATEWAY_NEEDS, "gateway")
    await streams.wait_for(worker.jetstream(), streams.WORKER_NEEDS, "worker")

    async def answer_open(msg) -> None:
        await msg.respond(DETOK_ID.encode())  # allow_responses: the one publish under _INBOX.gateway it may make

    await detok.subscribe(subjects.DETOK_OPEN, queue=subjects.DETOK_QUEUE, cb=answer_open)
    frames = await detok.subscribe(subjects.frames(DETOK_ID))
    detok_cancels = await detok.subscribe(subjects.CANCEL)
    chunks = await gateway.subscribe(subjects.responses(GATEWAY_ID))
    worker_cancels = await worker.subscribe(subjects.CANCEL)
    stops = await worker.subscribe(subjects.STOP)
    await asyncio.gather(barrier(detok), barrier(worker), barrier(gateway))

    assert (await gateway.request(subjects.DETOK_OPEN, b"open", timeout=WAIT_S)).data == DETOK_ID.encode()
    await gateway.jetstream().publish(subjects.REQUESTS, b"work", timeout=WAIT_S)
    pulled = await worker.jetstream().pull_subscribe_bind(CONSUMER, STREAM)
    (msg,) = await pulled.fetch(1, timeout=WAIT_S)
    await msg.in_progress()
    await worker.publish(subjects.frames(DETOK_ID), b"frame")
    assert (await frames.next_msg(WAIT_S)).data == b"frame"
    await detok.publish(subjects.responses(GATEWAY_ID), b"chunk")
    assert (await chunks.next_msg(WAIT_S)).data == b"chunk"
    await detok.publish(subjects.STOP, Cancel(request_id="r", reason="stop_string").to_bytes())
    assert Cancel.from_bytes((await stops.next_msg(WAIT_S)).data).reason == "stop_string"
    await gateway.publish(subjects.CANCEL, b"cancel")
    assert (await worker_cancels.next_msg(WAIT_S)).data == (await detok_cancels.next_msg(WAIT_S)).data == b"cancel"
    # A stopping worker hands its request back with its progress, then acknowledges the original.
    await worker.jetstream().publish(subjects.RESUMED_REQUESTS, b"resumed", timeout=WAIT_S)
    await msg.ack_sync(timeout=WAIT_S)
    (resumed,) = await pulled.fetch(1, timeout=WAIT_S)
    assert (resumed.subject, resumed.data) == (subjects.RESUMED_REQUESTS, b"resumed")
    await resumed.term()
    # The gateway stores a response, reads it back and deletes it (services/gateway/responses/store.py).
    store = await gateway.jetstream().key_value(subjects.RESPONSE_BUCKET)
    await store.put("resp_1", b"stored")
    assert (await store.get("resp_1")).value == b"stored"
    await store.delete("resp_1")
    await asyncio.gather(barrier(detok), barrier(worker), barrier(gateway))
    assert {role: e.reported for role, e in errors.items()} == {role: [] for role in SERVICE_ROLES}


@pytest.mark.parametrize(("role", "subject"), FORGERIES, ids=[f"{r}-publishes-{s}" for r, s in FORGERIES])
async def test_a_role_cannot_forge_another_roles_messages(connect: Callable, role: NatsRole, subject: str) -> None:
    watcher = await connect(NatsRole.ADMIN)
    seen = await watcher.subscribe(subject)
    await barrier(watcher)
    errors = Errors()
    forger = await connect(role, errors)
    await forger.publish(subject, FORGED)
    # The server handles the publish before the forger's PONG, and sends anything it routed to the watcher before
    # the watcher's own PONG: after both flushes a delivered message would be there.
    await barrier(forger)
    await barrier(watcher)
    assert seen.pending_msgs == 0, f"{role} published on {subject}"
    assert await errors.first_violations() == [f'nats: permissions violation for publish to "{subject.lower()}"']


@pytest.mark.parametrize(("role", "subject"), EAVESDROPPING, ids=[f"{r}-reads-{s}" for r, s in EAVESDROPPING])
async def test_a_role_cannot_read_what_is_not_its_own(connect: Callable, role: NatsRole, subject: str) -> None:
    errors = Errors()
    reader = await connect(role, errors)
    heard = await reader.subscribe(subject)
    await barrier(reader)
    publisher = await connect(NatsRole.ADMIN)
    await publisher.publish(subject.replace(">", "x"), FORGED)
    await barrier(publisher)
    await barrier(reader)
    assert heard.pending_msgs == 0, f"{role} read {subject}"
    assert await errors.first_violations() == [
        f'nats: permissions violation for subscription to "{subject.lower()}"'  # nats-py lowers the subject
    ]


def _matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: `*` is one token, a trailing `>` one or more."""
    want, have = pattern.split("."), subject.split(".")
    if want[-1] == ">":
        return len(have) >= len(want) and all(w in ("*", h) for w, h in zip(want[:-1], have))
    return len(want) == len(have) and all(w in ("*", h) for w, h in zip(want, have))


def test_every_subject_of_the_mesh_has_a_publisher_and_nobody_publishes_outside_them() -> None:
    """A subject added to shared/subjects.py without a role allowed to publish it would only fail at run time."""
    used = [value for name, value in vars(subjects).items() if name.isupper() and isinstance(value, str)
            and value.startswith(f"{subjects.PREFIX}.")]
    used += [function("x") for _, function in inspect.getmembers(subjects, inspect.isfunction)]
    for subject in used:
        publishers = [r for r in SERVICE_ROLES if any(_matches(p, subject) for p in PERMISSIONS[r].publish)]
        assert publishers, f"no role may publish {subject}"
    for role in SERVICE_ROLES:
        for pattern in PERMISSIONS[role].publish:
            if not pattern.startswith(("$JS.", "$KV.")):  # JetStream's API, and its key-value buckets
                assert any(_matches(pattern, subject) for subject in used), f"{role} may publish {pattern}, unused"


async def test_what_a_jetstream_consumer_delivers_on_a_services_subject_is_dropped(connect: Callable) -> None:
    """A worker's user may create consumers of the routed stream (its own, and a gone worker's it adopts). A push
    consumer delivers on any subject its creator names, past the creator's publish permissions: here, a cancel of
    someone else's request. Every core subscription's handler drops such deliveries (natsutil.core_only)."""
    worker, detok, gateway = await connect(NatsRole.WORKER), await connect(NatsRole.DETOKENIZER), await connect(
        NatsRole.GATEWAY
    )
    received: list[bytes] = []

    async def on_cancel(msg) -> None:
        received.append(msg.data)

    await detok.subscribe(subjects.CANCEL, cb=core_only(on_cancel))
    await barrier(detok)
    refused = _refusals()
    js = worker.jetstream()
    await js.add_consumer(subjects.ROUTED_STREAM, ConsumerConfig(
        durable_name="forger", deliver_subject=subjects.CANCEL, filter_subject=subjects.routed(FORGING_WORKER),
        ack_policy=AckPolicy.EXPLICIT,
    ))
    try:
        await js.publish(subjects.routed(FORGING_WORKER), FORGED, timeout=WAIT_S)
        await gateway.publish(subjects.CANCEL, b"a real cancel")
        deadline = asyncio.get_running_loop().time() + WAIT_S
        while _refusals() == refused or not received:
            assert asyncio.get_running_loop().time() < deadline, "the forged delivery never came"
            await asyncio.sleep(REPORT_POLL_S)
        assert received == [b"a real cancel"]
    finally:
        await js.delete_consumer(subjects.ROUTED_STREAM, "forger")


def _refusals() -> float:
    return REGISTRY.get_sample_value("specmesh_nats_jetstream_deliveries_refused_total") or 0.0


def test_every_core_subscription_of_the_services_drops_jetstream_deliveries() -> None:
    """A subscription added without core_only would take forged deliveries again."""
    root = Path(__file__).resolve().parents[1]
    for path in [*root.glob("services/**/*.py"), *root.glob("shared/*.py")]:
        for call in re.findall(r"\.subscribe\((.*?)\)\n", path.read_text(), re.S):
            assert "cb=core_only(" in call, f"{path.relative_to(root)}: subscribe({call.strip()[:80]}...)"
