"""The gateway's bounds on what one client may hold: connection and body time, concurrent streams, sequences in
the mesh. (The work queue's own limits are the streams' declarer's: shared/stream_limits.py.)

`specmesh gateway` takes them as options and `specmesh up` passes them on (`command_line`), so both accept the same
flags with the same defaults.
"""

from __future__ import annotations

import argparse

from pydantic import BaseModel, ConfigDict, Field

from shared import option_types

DEFAULT_IDLE_TIMEOUT_S = 15.0
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_MAX_CONCURRENT_PER_KEY = 64
NO_LIMIT = 0  # --max-in-flight 0: publish every admitted request at once (no fairness between keys)


class GatewayLimits(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # A connection with no request in progress (idle keep-alive, or headers not yet complete) is closed after this.
    idle_timeout_s: float = Field(DEFAULT_IDLE_TIMEOUT_S, gt=0.0)
    body_timeout_s: float = Field(DEFAULT_BODY_TIMEOUT_S, gt=0.0)  # a request's whole body must arrive within this
    # Streams one client (API key, else peer address) may hold at once, waiting or generating; past it, 429.
    max_concurrent_per_key: int = Field(DEFAULT_MAX_CONCURRENT_PER_KEY, ge=1)
    # Sequences (prompts x n) this gateway keeps in the mesh at once; more wait here, taken round robin by client
    # (admission.py). None: no bound.
    max_in_flight: int | None = Field(None, ge=1)

    def runner_options(self) -> dict[str, float]:
        """aiohttp's server options that enforce these limits (for web.AppRunner or a TestServer)."""
        # aiohttp arms its keep-alive timer when a connection opens and after each response, and closes the
        # connection when it fires with no request parsed: so it bounds slow headers as well as idle connections.
        return {"keepalive_timeout": self.idle_timeout_s}

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "GatewayLimits":
        return cls(
            idle_timeout_s=args.idle_timeout,
            body_timeout_s=args.body_timeout,
            max_concurrent_per_key=args.max_concurrent_per_key,
            max_in_flight=args.max_in_flight or None,
        )

    def command_line(self) -> list[str]:
        """The options that give these limits to a `specmesh gateway` process."""
        return [
            "--idle-timeout", str(self.idle_timeout_s), "--body-timeout", str(self.body_timeout_s),
            "--max-concurrent-per-key", str(self.max_concurrent_per_key),
            "--max-in-flight", str(self.max_in_flight or NO_LIMIT),
        ]


def add_arguments(
    parser: argparse.ArgumentParser, *, in_flight_default: int | None = NO_LIMIT, in_flight_help: str | None = None
) -> None:
    parser.add_argument(
        "--idle-timeout", type=option_types.seconds, default=DEFAULT_IDLE_TIMEOUT_S,
        help="seconds a connection may stay open without a complete request (idle keep-alive or slow headers)",
    )
    parser.add_argument(
        "--body-timeout", type=option_types.seconds, default=DEFAULT_BODY_TIMEOUT_S,
        help="seconds a request's body may take to arrive; slower ones get 408 and the connection is closed",
    )
    parser.add_argument(
        "--max-concurrent-per-key", type=option_types.at_least(1), default=DEFAULT_MAX_CONCURRENT_PER_KEY,
        help="streams one client (its API key, else its address) may hold at once; past it, 429",
    )
    parser.add_argument(
        "--max-in-flight", type=option_types.at_least(0), default=in_flight_default,
        help=in_flight_help or "sequences (prompts x n) in the mesh at once; more wait at the gateway and are admitted "
        "round robin between clients (0: no bound, no fairness)",
    )
