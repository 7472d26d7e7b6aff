"""Open requests that hear nothing for too long are let go: the detokenizer's backstop for a lost Cancel.

The gateway cancels every request whose client leaves (services/gateway/generation.py), but a Cancel can still
be lost: the gateway process dies, or its NATS connection drops at the wrong moment. Without a backstop the
detokenizer would keep such a request for good. A request that has had no frame for `idle_timeout_s` is closed,
counted and stopped at the workers. Keep the timeout above the gateway's --request-timeout, after which the
gateway itself gives up on a silent request: a request still waiting in the work queue has no frames either.
"""

from __future__ import annotations

from collections import OrderedDict

DEFAULT_IDLE_TIMEOUT_S = 900.0  # above the gateway's default --request-timeout (600 s)
MAX_SWEEP_INTERVAL_S = 5.0


class IdleRequests:
    """When each open request was last heard of, oldest first, so expired ones are found without a full scan."""

    def __init__(self, idle_timeout_s: float) -> None:
        self.idle_timeout_s = idle_timeout_s
        self._last_heard: OrderedDict[str, float] = OrderedDict()  # monotonic seconds, by request id

    @property
    def sweep_interval_s(self) -> float:
        """How often to look for expired requests: often enough that none outlives its timeout by more than half."""
        return min(self.idle_timeout_s / 2, MAX_SWEEP_INTERVAL_S)

    def heard(self, request_id: str, now: float) -> None:
        self._last_heard[request_id] = now
        self._last_heard.move_to_end(request_id)

    def forget(self, request_id: str) -> None:
        self._last_heard.pop(request_id, None)

    def expired(self, now: float) -> list[str]:
        """The requests silent for longer than the timeout (still tracked: forget them when closing them)."""
        silent = []
        for request_id, last in self._last_heard.items():
            if now - last <= self.idle_timeout_s:
                break
            silent.append(request_id)
        return silent
