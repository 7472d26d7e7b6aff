"""Whether the detokenizers holding a response's requests are still there, so that a stream never hangs on a dead one.

A stream can be silent for good reasons: its request waits in the work queue, or its worker died and another is
taking it over. So silence alone ends nothing before the request timeout; but once a response has heard nothing for
CHECK_AFTER_S, the gateway asks each detokenizer holding one of its requests which of them it still holds (HeldQuery),
and again every CHECK_AFTER_S while the silence lasts:

- nobody listens on the detokenizer's subject (it died: NATS answers "no responders" at once), or it has not answered
  for DETOK_LOST_S (it hangs, or NATS is out): the response ends with an error naming the detokenizer;
- it answers but no longer holds a request whose last chunk never came: the chunks were lost on the way (NATS was
  out), and the response ends with an error, after LATE_CHUNK_GRACE_S for a last chunk that crossed the answer.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

from nats.aio.client import Client

from shared import subjects
from shared.held_query import NobodyListens, ask_held

CHECK_AFTER_S = 1.0  # silence before a response asks after its detokenizers, and between two askings
ANSWER_TIMEOUT_S = 1.0  # a live detokenizer answers in milliseconds
DETOK_LOST_S = 3.0  # silence with no answer from a detokenizer before it is given up on
LATE_CHUNK_GRACE_S = 0.5  # a final chunk sent just before the detokenizer answered may still be on its way


class DetokenizerLost(Exception):
    """A response's request can no longer be answered: its detokenizer is gone or dropped it."""


class Liveness:
    """Checks on the detokenizers of one response's requests."""

    def __init__(self, nc: Client) -> None:
        self._nc = nc
        self._owners: dict[str, str] = {}  # request id -> the detokenizer that holds it
        self._answered = time.monotonic()  # when the detokenizers last answered, or a chunk came

    def owned_by(self, request_id: str, detok_id: str) -> None:
        self._owners[request_id] = detok_id

    def heard(self) -> None:
        """A chunk came: the silence starts over."""
        self._answered = time.monotonic()

    async def check(self, unfinished: list[str]) -> list[str]:
        """Asks the detokenizers of the unfinished requests; returns those no detokenizer holds any more (their last
        chunk may still be on its way). Raises DetokenizerLost when a detokenizer is gone."""
        by_detok: dict[str, list[str]] = defaultdict(list)
        for request_id in unfinished:
            if request_id in self._owners:  # a request not yet opened at a detokenizer has none to ask
                by_detok[self._owners[request_id]].append(request_id)
        answers = await asyncio.gather(*(self._ask(detok_id, ids) for detok_id, ids in by_detok.items()))
        if any(answer is None for answer in answers):
            if time.monotonic() - self._answered > DETOK_LOST_S:
                if not self._nc.is_connected:
                    raise DetokenizerLost(f"the gateway has been cut off from NATS for over {DETOK_LOST_S:g} s")
                lost = [d for d, answer in zip(by_detok, answers) if answer is None]
                raise DetokenizerLost(f"the detokenizer {lost[0]} has not answered for {DETOK_LOST_S:g} s")
            return []
        self._answered = time.monotonic()
        return [r for ids, held in zip(by_detok.values(), answers) for r in ids if r not in held]

    async def _ask(self, detok_id: str, request_ids: list[str]) -> set[str] | None:
        """The requests the detokenizer holds; None when it did not answer in time."""
        try:
            return await ask_held(self._nc, subjects.held(detok_id), request_ids, ANSWER_TIMEOUT_S)
        except NobodyListens:
            raise DetokenizerLost(f"the detokenizer {detok_id} that held the request is gone") from None
