"""KV handoffs over NATS, the embedded default (transport.py).

The sender splits the handoff's bytes into chunks of CHUNK_BYTES, under NATS's max_payload, and sends each as a
request on the receiver's subject (subjects.kv_transfer), WINDOW of them in flight; the receiver answers each. Every
chunk carries its transfer id, its index and count, and a BLAKE2b digest of its bytes: a corrupt, missing or
repeated chunk fails the transfer, and a handoff is decoded only once all its chunks arrived intact. The first
chunk is the offer: a receiver with no room for another request answers BUSY, and the sender keeps the bytes (its
lease) and offers them elsewhere or later. Completed transfers wait here for their request for TRANSFER_TTL_S.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from shared import subjects
from services.worker.handoff.transport import TransferFailed
from shared.natsutil import barrier, core_only

log = logging.getLogger("specmesh.worker")

CHUNK_BYTES = 768 * 1024  # under NATS's default max_payload of 1 MiB, with room for headers
WINDOW = 4  # chunks in flight: a round trip each would leave the link idle between chunks
CHUNK_TIMEOUT_S = 5.0
TRANSFER_TTL_S = 60.0  # a transfer whose request never came (its sender died between the two) is dropped
TRANSFER_HEADER = "Specmesh-Transfer"
CHUNK_HEADER = "Specmesh-Chunk"  # "index/count"
DIGEST_HEADER = "Specmesh-Digest"
DIGEST_BYTES = 16


class Reply:
    OK = b"ok"
    BUSY = b"busy"
    BAD = b"bad"  # followed by the reason


def digest(chunk: bytes | memoryview) -> str:
    return hashlib.blake2b(chunk, digest_size=DIGEST_BYTES).hexdigest()


@dataclass
class _Incoming:
    count: int
    started: float
    chunks: dict[int, bytes] = field(default_factory=dict)


class NatsKvTransport:
    def __init__(self, nc: Client, worker_id: int, has_room: Callable[[], bool] = lambda: True) -> None:
        """has_room: whether this (decode) worker takes another request now; the transfers it holds count too."""
        self.nc = nc
        self.worker_id = worker_id
        self._has_room = has_room
        self._incoming: dict[str, _Incoming] = {}
        self._complete: dict[str, tuple[float, bytes]] = {}
        self.bad_chunks = 0

    async def start(self) -> None:
        await self.nc.subscribe(subjects.kv_transfer(self.worker_id), cb=core_only(self._on_chunk))
        await barrier(self.nc)  # the server knows of the subscription before anyone is told this worker is up

    @property
    def num_held(self) -> int:
        self._expire()  # what no request came for stops holding room even while no chunk arrives
        return len(self._incoming) + len(self._complete)

    async def send(self, worker_id: int, transfer_id: str, payload: bytes) -> None:
        view = memoryview(payload)
        count = max(1, -(-len(view) // CHUNK_BYTES))
        subject = subjects.kv_transfer(worker_id)

        async def one(index: int) -> None:
            chunk = view[index * CHUNK_BYTES : (index + 1) * CHUNK_BYTES]
            headers = {TRANSFER_HEADER: transfer_id, CHUNK_HEADER: f"{index}/{count}", DIGEST_HEADER: digest(chunk)}
            try:
                reply = await self.nc.request(subject, bytes(chunk), timeout=CHUNK_TIMEOUT_S, headers=headers)
            except nats.errors.NoRespondersError:
                raise TransferFailed(f"no worker {worker_id} receives KV", gone=True) from None
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                raise TransferFailed(f"chunk {index}/{count} unanswered in {CHUNK_TIMEOUT_S}s") from None
            if reply.data == Reply.BUSY:
                raise TransferFailed(f"worker {worker_id} has no room", busy=True)
            if reply.data != Reply.OK:
                raise TransferFailed(f"worker {worker_id} refused chunk {index}/{count}: {reply.data[:200]!r}")

        await one(0)  # the offer: nothing more is sent to a receiver without room
        for first in range(1, count, WINDOW):
            await asyncio.gather(*(one(i) for i in range(first, min(first + WINDOW, count))))

    def take(self, transfer_id: str) -> bytes | None:
        """The bytes of a transfer that arrived whole, for its request, which holds them no longer; a transfer
        still arriving (its sender gave up on it) is dropped."""
        self._incoming.pop(transfer_id, None)
        entry = self._complete.pop(transfer_id, None)
        return None if entry is None else entry[1]

    async def _on_chunk(self, msg: Msg) -> None:
        self._expire()
        answer = self._receive(msg)
        if answer.startswith(Reply.BAD):
            self.bad_chunks += 1
            log.warning("KV chunk refused: %s", answer.decode(errors="replace"))
        try:
            await msg.respond(answer)
        except nats.errors.Error as exc:  # the sender gave up meanwhile; it will recompute or retry
            log.debug("could not answer a KV chunk: %r", exc)

    def _receive(self, msg: Msg) -> bytes:
        headers = msg.headers or {}
        transfer_id = headers.get(TRANSFER_HEADER, "")
        try:
            index, count = (int(n) for n in headers.get(CHUNK_HEADER, "").split("/"))
        except ValueError:
            return Reply.BAD + b" no chunk index"
        if not transfer_id or not 0 <= index < count:
            return Reply.BAD + b" no transfer id or index out of range"
        if digest(msg.data) != headers.get(DIGEST_HEADER):
            self._incoming.pop(transfer_id, None)  # never decoded: the request is recomputed
            return Reply.BAD + f" chunk {index}/{count} fails its digest".encode()
        if index == 0:
            if not self._has_room():
                return Reply.BUSY
            self._incoming[transfer_id] = _Incoming(count, time.monotonic())
        incoming = self._incoming.get(transfer_id)
        if incoming is None or incoming.count != count or index in incoming.chunks:
            self._incoming.pop(transfer_id, None)
            return Reply.BAD + f" chunk {index}/{count} repeated or of an unknown transfer".encode()
        incoming.chunks[index] = msg.data
        if len(incoming.chunks) == count:
            del self._incoming[transfer_id]
            self._complete[transfer_id] = (time.monotonic(), b"".join(incoming.chunks[i] for i in range(count)))
        return Reply.OK

    def _expire(self) -> None:
        deadline = time.monotonic() - TRANSFER_TTL_S
        for transfer_id in [t for t, i in self._incoming.items() if i.started < deadline]:
            del self._incoming[transfer_id]
        for transfer_id in [t for t, (done, _) in self._complete.items() if done < deadline]:
            del self._complete[transfer_id]
