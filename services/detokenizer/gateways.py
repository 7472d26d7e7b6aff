"""Whether the gateways waiting for this detokenizer's requests still wait for them, so that a gateway that died
(kill -9, out of memory) does not leave its requests running on the workers to their last token for nobody.

A gateway cancels each request whose client leaves, and a stopped one ends its streams with a 503, which cancels
them too; a gateway that dies does neither, and the requests' frames keep coming, so the idle timeout (reaper.py)
never fires. Every --gateway-check-interval the detokenizer asks each gateway its open requests' chunks go to which
of them it still waits for (subjects.gateway_held, a HeldQuery, the question the gateway asks detokenizers the other
way round: services/gateway/liveness.py):

- it answers: those it no longer waits for (their Cancel was lost on the way) are abandoned;
- nobody listens on its subject (NATS answers "no responders"), at two checks in a row: the gateway is gone, and all
  of its requests are abandoned. One such answer decides nothing: a gateway reconnecting to NATS (a network blip, a
  server in lame-duck mode) is briefly not subscribed;
- no answer within ANSWER_TIMEOUT_S (the gateway is busy, or NATS is out), or an error: nothing is decided.

The detokenizer closes abandoned requests and stops them at the workers (handlers.py), and decides nothing from "no
responders" for a grace after its own reconnect, when the gateways may not have resubscribed yet. A gateway from
before this check answers nothing: `--gateway-check-interval 0` turns the check off while one still runs.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Iterable

from nats.aio.client import Client

from shared import subjects
from shared.held_query import NobodyListens, ask_held

log = logging.getLogger(__name__)

DEFAULT_CHECK_INTERVAL_S = 5.0
ANSWER_TIMEOUT_S = 2.0  # a live gateway answers in milliseconds
MAX_IDS_PER_QUERY = 1024  # ~36 KB a question, well inside NATS's message limit


RESPONSES_PREFIX = subjects.responses("")  # a gateway's chunks go to this, then its id


def gateway_of(reply_subject: str) -> str | None:
    """The id of the gateway whose chunks go to `reply_subject`; None for a subject no gateway reads this way."""
    gateway_id = reply_subject.removeprefix(RESPONSES_PREFIX)
    return gateway_id if gateway_id != reply_subject and gateway_id and "." not in gateway_id else None


class GatewayChecks:
    """The gateways' answers over successive checks: which gateways went unanswered at the last one."""

    def __init__(self, nc: Client) -> None:
        self._nc = nc
        self._unanswered: set[str] = set()  # gateway ids nobody listened for at the last check

    async def abandoned(self, open_requests: Iterable[tuple[str, str]], judge_silence: bool = True) -> list[str]:
        """Of the open requests, given as (request id, the subject their chunks go to), those no gateway waits for.
        `judge_silence` false: "no responders" counts for nothing this time (the detokenizer just reconnected)."""
        by_gateway: dict[str, list[str]] = defaultdict(list)
        for request_id, reply_subject in open_requests:
            if (gateway_id := gateway_of(reply_subject)) is not None:
                by_gateway[gateway_id].append(request_id)
        queries = [(gateway_id, request_ids[start : start + MAX_IDS_PER_QUERY])
                   for gateway_id, request_ids in by_gateway.items()
                   for start in range(0, len(request_ids), MAX_IDS_PER_QUERY)]
        answers = await asyncio.gather(*(_not_held(self._nc, gateway_id, ids) for gateway_id, ids in queries),
                                       return_exceptions=True)
        unanswered, dropped = set(), []
        for (gateway_id, ids), answer in zip(queries, answers):
            if isinstance(answer, BaseException):
                log.warning("asking gateway %s after its requests failed: %r", gateway_id, answer)
            elif answer is None:
                unanswered.add(gateway_id)
                if judge_silence and gateway_id in self._unanswered:
                    log.warning("gateway %s is gone: its %d requests are abandoned", gateway_id, len(ids))
                    dropped += ids
            else:
                dropped += answer
        self._unanswered = unanswered if judge_silence else set()
        return dropped


async def _not_held(nc: Client, gateway_id: str, request_ids: list[str]) -> list[str] | None:
    """Those of the requests the gateway no longer waits for (none when it did not answer); None when nobody
    listens for it."""
    try:
        held = await ask_held(nc, subjects.gateway_held(gateway_id), request_ids, ANSWER_TIMEOUT_S)
    except NobodyListens:
        return None
    return [] if held is None else [request_id for request_id in request_ids if request_id not in held]
