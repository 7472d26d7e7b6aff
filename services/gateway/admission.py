"""Admission: how many streams one client may hold, and which client's request enters the mesh next.

Where fairness can live. Workers pull requests from one JetStream work queue, oldest first; neither the stream
nor a worker knows clients, and a request once published is served in publishing order. So the order must be
decided before publishing, and the gateway decides it: it keeps at most `max_in_flight` sequences (prompts x n)
in the mesh. A request enters a prompt at a time (its n choices together): while there is room a prompt is
published at once. When there is none, prompts wait here in one queue per client, and each slot that frees goes to
the waiting client served least recently (round robin), so a client with twenty prompts waiting, in one request or
in twenty, gets every other slot while another client waits, not the next twenty. A batch of thousands of prompts
thus shares the mesh instead of holding it until it ends. Set
`max_in_flight` to the batch slots of the workers (`specmesh up` uses workers x max-num-seqs): then the mesh's
own queue stays short and the order chosen here is the order served.

A client is its API key when the gateway checks keys, else its peer address (an unchecked bearer token could be
made up per request); see identity.py. A client holds at most `max_per_key` requests, waiting or generating; one
more is refused with 429 at once.

Nothing waits unbounded: a prompt waits here at most `max_wait_s` (the request timeout), then its request gets 503
with Retry-After, and a client that leaves while waiting gives up its place at once. Fairness is per gateway: with
several gateways, give each its share of the workers' slots.
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from services.gateway import metrics
from services.gateway.errors import RATE_LIMIT, RATE_LIMIT_EXCEEDED, UNAVAILABLE, OpenAIError

TOO_MANY_REQUESTS = 429
SERVICE_UNAVAILABLE = 503
RETRY_AFTER_S = 1  # what a refused client is told to wait before trying again
RETRY_AFTER = {"Retry-After": str(RETRY_AFTER_S)}  # the headers that tell it (OpenAIError copies them)
NEVER_ADMITTED = -1  # the turn of a client none of whose current streams has been admitted yet


@dataclass(eq=False)
class _Ticket:
    """A prompt waiting for room in the mesh."""

    key: str
    weight: int  # sequences it will hold
    granted: asyncio.Future[None]


class Places:
    """One request's places in the mesh: its prompts take theirs as they enter and give them back as they end."""

    def __init__(self, admission: "Admission", key: str) -> None:
        self._admission = admission
        self._key = key
        self.held = 0  # sequences of this request's prompts admitted and not yet ended

    async def take(self, weight: int) -> None:
        """Waits for room for `weight` more sequences, in the client's turn; 503 after the admission's max wait."""
        await self._admission._enter(self._key, weight)
        self.held += weight

    def give_back(self, weight: int) -> None:
        assert 0 < weight <= self.held, f"giving back {weight} places of {self.held} held"
        self.held -= weight
        self._admission._leave(weight)


class Admission:
    def __init__(self, max_in_flight: int | None, max_per_key: int, max_wait_s: float) -> None:
        self._max_in_flight = max_in_flight
        self._max_per_key = max_per_key
        self._max_wait_s = max_wait_s
        self._in_flight = 0  # sequences of the prompts admitted and not yet ended
        self._requests: Counter[str] = Counter()  # each client's requests, waiting or admitted
        self._waiting: dict[str, deque[_Ticket]] = {}  # by client, each client's in arrival order
        # When each client with requests was last admitted (a count of admissions): the next slot goes to the
        # waiting client with the oldest, one never admitted first.
        self._admitted_at: dict[str, int] = {}
        self._admissions = 0
        metrics.SEQUENCES_IN_FLIGHT.set_function(lambda: self._in_flight)
        metrics.ADMISSION_WAITING.set_function(lambda: sum(len(t) for t in self._waiting.values()))

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @asynccontextmanager
    async def request(self, key: str) -> AsyncIterator[Places]:
        """One request of client `key`, counted against its bound for the duration of the block; its prompts take
        their places through what it yields, and whatever they still hold is given back when the block ends."""
        if self._requests[key] >= self._max_per_key:
            metrics.ADMISSION_REFUSED.labels("per_key_limit").inc()
            raise OpenAIError(
                TOO_MANY_REQUESTS,
                f"Too many concurrent requests from this client: at most {self._max_per_key} at once",
                type=RATE_LIMIT,
                code=RATE_LIMIT_EXCEEDED,
                headers=RETRY_AFTER,
            )
        self._requests[key] += 1
        places = Places(self, key)
        try:
            yield places
        finally:
            if places.held:
                places.give_back(places.held)
            self._requests[key] -= 1
            if not self._requests[key]:
                del self._requests[key]
                self._admitted_at.pop(key, None)

    def _fits(self, weight: int) -> bool:
        # A prompt larger than the whole bound (n above it) still runs, alone.
        return self._max_in_flight is None or not self._in_flight or self._in_flight + weight <= self._max_in_flight

    async def _enter(self, key: str, weight: int) -> None:
        if not self._waiting and self._fits(weight):
            self._take(key, weight)
            return
        ticket = _Ticket(key, weight, asyncio.get_running_loop().create_future())
        self._waiting.setdefault(key, deque()).append(ticket)
        try:
            async with asyncio.timeout(self._max_wait_s):
                await ticket.granted
        except (TimeoutError, asyncio.CancelledError) as exc:
            if ticket.granted.done() and not ticket.granted.cancelled():
                self._leave(weight)  # granted in the moment it was given up
            else:
                self._withdraw(ticket)
            if isinstance(exc, TimeoutError):
                metrics.ADMISSION_REFUSED.labels("wait_timeout").inc()
                raise OpenAIError(
                    SERVICE_UNAVAILABLE,
                    f"The mesh is at capacity: no room for this request within {self._max_wait_s:g} s",
                    type=UNAVAILABLE,
                    headers=RETRY_AFTER,
                ) from None
            raise

    def _take(self, key: str, weight: int) -> None:
        self._in_flight += weight
        self._admissions += 1
        self._admitted_at[key] = self._admissions

    def _leave(self, weight: int) -> None:
        self._in_flight -= weight
        self._dispatch()

    def _withdraw(self, ticket: _Ticket) -> None:
        tickets = self._waiting.get(ticket.key, ())
        if ticket in tickets:  # else _dispatch already dropped it, cancelled
            tickets.remove(ticket)
            if not tickets:
                del self._waiting[ticket.key]
        self._dispatch()  # the withdrawn prompt may have been the one that did not fit

    def _dispatch(self) -> None:
        """Admits waiting prompts while they fit, each from the client whose turn it is."""
        while self._waiting:
            key = min(self._waiting, key=lambda k: self._admitted_at.get(k, NEVER_ADMITTED))
            tickets = self._waiting[key]
            if tickets[0].granted.cancelled():
                # A cancelled waiter's future is cancelled at once; its own clean-up (_withdraw) runs a moment later.
                tickets.popleft()
            elif self._fits(tickets[0].weight):
                ticket = tickets.popleft()
                self._take(key, ticket.weight)
                ticket.granted.set_result(None)
            else:
                return
            if not tickets:
                del self._waiting[key]
