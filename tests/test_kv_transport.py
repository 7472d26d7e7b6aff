"""KV transfers between two workers over a real NATS server, each connected as the worker role (so its permissions
are exercised too): a handoff larger than a chunk arrives whole; a corrupt chunk, a busy receiver and a receiver
that is gone are told apart, and a transfer that failed is never handed to the engine."""

from __future__ import annotations

import os
import uuid

import pytest

from shared import subjects
from shared.nats_roles import NatsRole
from shared.natsutil import connect
from services.worker.handoff import nats_transport
from services.worker.handoff.nats_transport import CHUNK_BYTES, Reply, NatsKvTransport
from services.worker.handoff.transport import TransferFailed
from tests.natsfixture import nats_server  # noqa: F401  (a fixture, used by name)

SENDER, RECEIVER = 1, 2


@pytest.fixture
async def pair(nats_server):  # noqa: F811
    connections = [await connect(nats_server.settings(NatsRole.WORKER), "worker") for _ in range(2)]
    room = {"free": True}
    sender = NatsKvTransport(connections[0], SENDER)
    receiver = NatsKvTransport(connections[1], RECEIVER, has_room=lambda: room["free"])
    await receiver.start()
    yield sender, receiver, room
    for nc in connections:
        await nc.close()


async def test_a_handoff_of_several_chunks_arrives_whole_and_is_taken_once(pair) -> None:
    sender, receiver, _ = pair
    payload = os.urandom(3 * CHUNK_BYTES + 12345)
    transfer_id = uuid.uuid4().hex
    await sender.send(RECEIVER, transfer_id, payload)
    assert receiver.num_held == 1
    assert receiver.take(transfer_id) == payload
    assert receiver.take(transfer_id) is None and receiver.num_held == 0


async def test_a_busy_receiver_takes_nothing_and_a_gone_one_is_named(pair) -> None:
    sender, receiver, room = pair
    room["free"] = False
    with pytest.raises(TransferFailed) as busy:
        await sender.send(RECEIVER, uuid.uuid4().hex, b"kv" * 1000)
    assert busy.value.busy and not busy.value.gone and receiver.num_held == 0
    with pytest.raises(TransferFailed) as gone:
        await sender.send(99, uuid.uuid4().hex, b"kv")
    assert gone.value.gone


async def test_a_corrupt_or_missing_chunk_fails_the_transfer_and_nothing_is_decoded(pair, monkeypatch) -> None:
    sender, receiver, _ = pair
    transfer_id = uuid.uuid4().hex
    real_digest = nats_transport.digest
    calls = {"n": 0}

    def one_wrong(chunk) -> str:  # the second chunk's digest is not its bytes'
        calls["n"] += 1
        return "0" * 32 if calls["n"] == 2 else real_digest(chunk)

    monkeypatch.setattr(nats_transport, "digest", one_wrong)
    with pytest.raises(TransferFailed, match="fails its digest") as corrupt:
        await sender.send(RECEIVER, transfer_id, os.urandom(2 * CHUNK_BYTES))
    assert not corrupt.value.gone and not corrupt.value.busy
    monkeypatch.setattr(nats_transport, "digest", real_digest)
    assert receiver.take(transfer_id) is None and receiver.bad_chunks >= 1
    # A chunk of a transfer whose first chunk never came (lost, or from a sender that restarted) is refused too.
    reply = await sender.nc.request(subjects.kv_transfer(RECEIVER), b"x", headers={
        nats_transport.TRANSFER_HEADER: uuid.uuid4().hex, nats_transport.CHUNK_HEADER: "1/2",
        nats_transport.DIGEST_HEADER: real_digest(b"x"),
    })
    assert reply.data.startswith(Reply.BAD)
    assert receiver.num_held == 0


async def test_transfers_whose_request_never_came_expire(pair, monkeypatch) -> None:
    sender, receiver, _ = pair
    transfer_id = uuid.uuid4().hex
    await sender.send(RECEIVER, transfer_id, b"kv")
    monkeypatch.setattr(nats_transport, "TRANSFER_TTL_S", -1.0)
    await sender.send(RECEIVER, uuid.uuid4().hex, b"kv")  # each chunk received sweeps what expired
    assert receiver.take(transfer_id) is None


async def test_a_transfer_its_sender_gave_up_on_is_let_go_when_its_request_comes(pair) -> None:
    """The first chunk arrived, the rest never will (the sender timed out and sent the request without its KV): the
    request's take lets the part held go, instead of counting it against the receiver's room for a minute."""
    sender, receiver, _ = pair
    transfer_id = uuid.uuid4().hex
    chunk = b"kv"
    reply = await sender.nc.request(subjects.kv_transfer(RECEIVER), chunk, headers={
        nats_transport.TRANSFER_HEADER: transfer_id, nats_transport.CHUNK_HEADER: "0/2",
        nats_transport.DIGEST_HEADER: nats_transport.digest(chunk),
    })
    assert reply.data == Reply.OK and receiver.num_held == 1
    assert receiver.take(transfer_id) is None and receiver.num_held == 0
