"""Routes the Chunks arriving on this gateway's one response subject to the requests waiting for them.

A response reads the chunks of its requests (one per prompt of a completions prompt list) through one
`ResponseStream`, which enforces the protocol per request: `seq` counts up from 0 without gaps, a final chunk
ends that request, and silence longer than the request timeout is a failure rather than a hang. The stream ends
when every request has ended. While it is silent, it asks after the detokenizers holding its requests
(liveness.py), so that one that died ends the stream within seconds; the other way, the router answers a
detokenizer that asks which of its requests this gateway still waits for (services/detokenizer/gateways.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import orjson
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from pydantic import ValidationError

from services.gateway import metrics
from services.gateway.errors import SERVER_ERROR, TIMEOUT, OpenAIError
from services.gateway.liveness import CHECK_AFTER_S, LATE_CHUNK_GRACE_S, DetokenizerLost, Liveness
from shared import subjects
from shared.natsutil import MAX_PENDING_BYTES, core_only
from shared.schemas import Chunk, HeldQuery, HeldReport

log = logging.getLogger(__name__)

GATEWAY_TIMEOUT = 504
GENERATION_FAILED = 500
BAD_REQUEST = 400  # the request's own error, found only as it ran (its constraint failed)
UPSTREAM_LOST = 502  # the detokenizer holding the request is gone, or its chunks were lost


class ResponseStream:
    """The chunks of one response's requests, each request's in order (requests interleave as their chunks
    arrive); iterating raises OpenAIError on a gap, a timeout or a reported error."""

    def __init__(
        self, request_ids: list[str], queue: asyncio.Queue[Chunk | OpenAIError], idle_timeout_s: float,
        liveness: Liveness, on_final: Callable[[str], None] = lambda request_id: None,
        constraint_param: str | None = None,
    ) -> None:
        self._queue = queue
        self._idle_timeout_s = idle_timeout_s
        self.liveness = liveness  # told which detokenizer holds each request as they are opened
        self._on_final = on_final  # told of each request whose final chunk arrived
        self._constraint_param = constraint_param  # the parameter that constrains the output, named in its errors
        # Of the requests still open: one whose final chunk arrived is already forgotten by its detokenizer.
        self._next_seq = dict.fromkeys(request_ids, 0)

    @property
    def finished(self) -> bool:
        return not self._next_seq

    @property
    def unfinished(self) -> list[str]:
        """The requests still live in the mesh."""
        return list(self._next_seq)

    def __aiter__(self) -> "ResponseStream":
        return self

    async def __anext__(self) -> Chunk:
        if self.finished:
            raise StopAsyncIteration
        chunk = await self._next_chunk()
        if isinstance(chunk, OpenAIError):
            raise chunk
        expected = self._next_seq[chunk.request_id]
        if chunk.seq != expected:
            raise OpenAIError(
                GENERATION_FAILED,
                f"response chunks were lost (expected chunk {expected}, got {chunk.seq})",
                type=SERVER_ERROR,
            )
        self._next_seq[chunk.request_id] = expected + 1
        if chunk.final:
            del self._next_seq[chunk.request_id]
            self._on_final(chunk.request_id)
        if chunk.error is not None and chunk.request_error:
            raise OpenAIError(BAD_REQUEST, f"{self._constraint_param}: {chunk.error}", param=self._constraint_param)
        if chunk.error is not None:
            raise OpenAIError(GENERATION_FAILED, f"generation failed: {chunk.error}", type=SERVER_ERROR)
        return chunk

    def fail(self, error: OpenAIError) -> None:
        """Ends the response with `error` once the chunks already in are read: the response's requests could not
        all be submitted."""
        self._queue.put_nowait(error)

    async def _next_chunk(self) -> Chunk | OpenAIError:
        """The next chunk of any of the requests; while none comes, asks after their detokenizers every
        CHECK_AFTER_S."""
        deadline = time.monotonic() + self._idle_timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if (chunk := await self._get(min(left, CHECK_AFTER_S))) is not None:
                return chunk
            if time.monotonic() >= deadline:
                break
            try:
                dropped = await self.liveness.check(self.unfinished)
            except DetokenizerLost as exc:
                raise OpenAIError(UPSTREAM_LOST, f"generation failed: {exc}", type=SERVER_ERROR) from None
            if dropped and (chunk := await self._get(LATE_CHUNK_GRACE_S)) is None:
                raise OpenAIError(
                    UPSTREAM_LOST, f"generation failed: the detokenizer no longer holds request {dropped[0]}, whose "
                    "last chunks were lost on the way", type=SERVER_ERROR,
                )
            if chunk is not None:
                return chunk
        raise OpenAIError(GATEWAY_TIMEOUT, f"no response from the mesh for {self._idle_timeout_s:g} s", type=TIMEOUT)

    @property
    def has_ready(self) -> bool:
        """Whether a chunk is already waiting: the next one comes without a wait."""
        return not self._queue.empty()

    async def _get(self, timeout_s: float) -> Chunk | OpenAIError | None:
        if not self._queue.empty():  # no timeout to arm and cancel: ~7% of the gateway's time under 32 streams
            self.liveness.heard()
            return self._queue.get_nowait()
        try:
            # asyncio.timeout, unlike wait_for, does not wrap every wait in a task of its own.
            async with asyncio.timeout(timeout_s):
                chunk = await self._queue.get()
        except TimeoutError:
            return None
        self.liveness.heard()
        return chunk


class ChunkRouter:
    """Owns the gateway's subscription on subjects.responses(gateway_id) and one queue per open request."""

    def __init__(self, nc: Client, gateway_id: str, idle_timeout_s: float) -> None:
        self._nc = nc
        self.gateway_id = gateway_id
        self.subject = subjects.responses(gateway_id)
        self._idle_timeout_s = idle_timeout_s
        self._queues: dict[str, asyncio.Queue[Chunk | OpenAIError]] = {}
        self._subscriptions: list[Subscription] = []

    async def start(self) -> None:
        self._subscriptions = [
            await self._nc.subscribe(
                self.subject, cb=core_only(self._on_message), pending_bytes_limit=MAX_PENDING_BYTES
            ),
            await self._nc.subscribe(subjects.gateway_held(self.gateway_id), cb=core_only(self._on_held)),
        ]

    async def stop(self) -> None:
        if not self._nc.is_closed:
            for subscription in self._subscriptions:
                await subscription.unsubscribe()
        self._subscriptions = []

    async def _on_held(self, msg: Msg) -> None:
        """A detokenizer asks which of its requests this gateway still waits for: it stops the others."""
        try:
            query = HeldQuery.from_bytes(msg.data)
        except (orjson.JSONDecodeError, ValidationError) as exc:
            metrics.BAD_HELD_QUERIES.inc()
            log.warning("dropping an undecodable HeldQuery: %s", exc)
            return
        held = tuple(request_id for request_id in query.request_ids if request_id in self._queues)
        await msg.respond(HeldReport(request_ids=held).to_bytes())

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
    def open(
        self, request_ids: list[str], on_final: Callable[[str], None] = lambda request_id: None,
        constraint_param: str | None = None,
    ) -> Iterator[ResponseStream]:
        """Registers a response's requests before anything is published, so not even a first chunk can be missed;
        their chunks go into one queue. `on_final` is told of each request as its final chunk is read; a run-time
        failure of the output's constraint is a 400 naming `constraint_param`."""
        if already := [r for r in request_ids if r in self._queues]:
            raise ValueError(f"requests {already} are already open")
        queue: asyncio.Queue[Chunk | OpenAIError] = asyncio.Queue()
        for request_id in request_ids:
            self._queues[request_id] = queue
        try:
            yield ResponseStream(
                request_ids, queue, self._idle_timeout_s, Liveness(self._nc), on_final, constraint_param
            )
        finally:
            for request_id in request_ids:
                del self._queues[request_id]

    def fail_all(self, error: OpenAIError) -> None:
        """Ends every open response with `error` once the chunks already in are read."""
        for queue in {id(q): q for q in self._queues.values()}.values():
            queue.put_nowait(error)

    @property
    def num_open(self) -> int:
        return len(self._queues)
