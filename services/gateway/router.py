"""Routes the Chunks arriving on this gateway's one response subject to the requests waiting for them.

Each request reads its chunks through a `ResponseStream`, which enforces the protocol: `seq` counts up
from 0 without gaps, a final chunk ends the stream, and silence longer than the request timeout is a
failure rather than a hang.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from contextlib import contextmanager

import orjson
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from pydantic import ValidationError

from services.gateway import metrics
from services.gateway.errors import SERVER_ERROR, TIMEOUT, OpenAIError
from shared import subjects
from shared.natsutil import MAX_PENDING_BYTES
from shared.schemas import Chunk

log = logging.getLogger(__name__)

GATEWAY_TIMEOUT = 504
GENERATION_FAILED = 500


class ResponseStream:
    """One request's chunks, in order; iterating raises OpenAIError on a gap, a timeout or a reported error."""

    def __init__(self, request_id: str, queue: asyncio.Queue[Chunk], idle_timeout_s: float) -> None:
        self.request_id = request_id
        self._queue = queue
        self._idle_timeout_s = idle_timeout_s
        self._next_seq = 0
        self.finished = False  # a final chunk arrived: the detokenizer has already forgotten the request

    def __aiter__(self) -> "ResponseStream":
        return self

    async def __anext__(self) -> Chunk:
        if self.finished:
            raise StopAsyncIteration
        try:
            # asyncio.timeout, unlike wait_for, does not wrap every wait in a task of its own.
            async with asyncio.timeout(self._idle_timeout_s):
                chunk = await self._queue.get()
        except TimeoutError:
            raise OpenAIError(
                GATEWAY_TIMEOUT, f"no response from the mesh for {self._idle_timeout_s:g} s", type=TIMEOUT
            ) from None
        if chunk.seq != self._next_seq:
            raise OpenAIError(
                GENERATION_FAILED,
                f"response chunks were lost (expected chunk {self._next_seq}, got {chunk.seq})",
                type=SERVER_ERROR,
            )
        self._next_seq += 1
        self.finished = chunk.final
        if chunk.error is not None:
            raise OpenAIError(GENERATION_FAILED, f"generation failed: {chunk.error}", type=SERVER_ERROR)
        return chunk


class ChunkRouter:
    """Owns the gateway's subscription on subjects.responses(gateway_id) and one queue per open request."""

    def __init__(self, nc: Client, gateway_id: str, idle_timeout_s: float) -> None:
        self._nc = nc
        self.subject = subjects.responses(gateway_id)
        self._idle_timeout_s = idle_timeout_s
        self._queues: dict[str, asyncio.Queue[Chunk]] = {}
        self._subscription: Subscription | None = None

    async def start(self) -> None:
        self._subscription = await self._nc.subscribe(
            self.subject, cb=self._on_message, pending_bytes_limit=MAX_PENDING_BYTES
        )

    async def stop(self) -> None:
        if self._subscription is not None and not self._nc.is_closed:
            await self._subscription.unsubscribe()
        self._subscription = None

    async def _on_message(self, msg: Msg) -> None:
        try:
            chunk = Chunk.from_bytes(msg.data)
        except (orjson.JSONDecodeError, ValidationError) as exc:
            metrics.BAD_CHUNKS.inc()
            log.warning("dropping an undecodable chunk on %s: %s", self.subject, exc)
            return
        queue = self._queues.get(chunk.request_id)
        if queue is None:
            # Chunks still in flight when a request was cancelled or timed out end up here.
            log.debug("dropping chunk %d of request %s, which is no longer open", chunk.seq, chunk.request_id)
            return
        queue.put_nowait(chunk)

    @contextmanager
    def open(self, request_id: str) -> Iterator[ResponseStream]:
        """Registers the request before anything is published, so not even its first chunk can be missed."""
        if request_id in self._queues:
            raise ValueError(f"request {request_id} is already open")
        queue: asyncio.Queue[Chunk] = asyncio.Queue()
        self._queues[request_id] = queue
        try:
            yield ResponseStream(request_id, queue, self._idle_timeout_s)
        finally:
            del self._queues[request_id]

    @property
    def num_open(self) -> int:
        return len(self._queues)
