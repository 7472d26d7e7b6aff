"""Limits on the JetStream work queue, so that a flood of requests is refused at once instead of piling up.

The stream discards *new* messages once a limit is reached: the publish that would cross it fails immediately, and
the gateway answers that client 503 with Retry-After (services/gateway/generation.py), while every request already
queued keeps its place. Whoever declares the streams sets these limits (shared/streams.py: `specmesh up`,
`specmesh nats` or `specmesh streams`); the services cannot change them.

A worker that drains hands its unfinished requests back through the same stream; a hand-back refused by a full
stream stays unacknowledged, and JetStream redelivers it after the consumer's ack_wait.
"""

from __future__ import annotations

import argparse

from nats.js.api import DiscardPolicy
from pydantic import BaseModel, ConfigDict, Field

from shared import option_types

MIB = 1024 * 1024
DEFAULT_MAX_MSGS = 10_000
DEFAULT_MAX_BYTES = 1024 * MIB
# Longer than any request may wait silently at the gateway (its --request-timeout, 600 s by default): a message
# older than this has no client left. JetStream removes it even while a worker holds it.
DEFAULT_MAX_AGE_S = 3600.0
# Stored responses (POST /v1/responses): kept as long as OpenAI keeps them, unless the store fills first, when the
# oldest go.
DEFAULT_RESPONSE_STORE_MAX_AGE_S = 30 * 24 * 3600.0
DEFAULT_RESPONSE_STORE_MAX_BYTES = 1024 * MIB


class StreamLimits(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_msgs: int = Field(DEFAULT_MAX_MSGS, ge=1)  # requests queued or being worked on
    max_bytes: int = Field(DEFAULT_MAX_BYTES, ge=1)  # their total size
    max_age_s: float = Field(DEFAULT_MAX_AGE_S, gt=0.0)  # how long a request may stay in the stream
    response_store_max_age_s: float = Field(DEFAULT_RESPONSE_STORE_MAX_AGE_S, gt=0.0)
    response_store_max_bytes: int = Field(DEFAULT_RESPONSE_STORE_MAX_BYTES, ge=1)

    def stream_options(self) -> dict[str, object]:
        """The StreamConfig fields these limits set."""
        return {
            "max_msgs": self.max_msgs,
            "max_bytes": self.max_bytes,
            "max_age": self.max_age_s,
            "discard": DiscardPolicy.NEW,
        }

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "StreamLimits":
        return cls(
            max_msgs=args.queue_max_msgs, max_bytes=args.queue_max_bytes, max_age_s=args.queue_max_age,
            response_store_max_age_s=args.response_store_max_age,
            response_store_max_bytes=args.response_store_max_bytes,
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--queue-max-msgs", type=option_types.at_least(1), default=DEFAULT_MAX_MSGS,
        help="work queue: the most requests queued or in progress; past it new requests get 503",
    )
    parser.add_argument(
        "--queue-max-bytes", type=option_types.at_least(1), default=DEFAULT_MAX_BYTES,
        help="work queue: the most bytes of requests stored; past it new requests get 503",
    )
    parser.add_argument(
        "--queue-max-age", type=option_types.seconds, default=DEFAULT_MAX_AGE_S,
        help="work queue: seconds a request may stay in the stream before JetStream removes it",
    )
    parser.add_argument(
        "--response-store-max-age", type=option_types.seconds, default=DEFAULT_RESPONSE_STORE_MAX_AGE_S,
        help="stored responses (POST /v1/responses with store): seconds one is kept (default 30 days)",
    )
    parser.add_argument(
        "--response-store-max-bytes", type=option_types.at_least(1), default=DEFAULT_RESPONSE_STORE_MAX_BYTES,
        help="stored responses: the most bytes kept; past it the oldest are dropped",
    )
