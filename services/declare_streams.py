"""`specmesh streams`: declare the mesh's JetStream streams and shared consumers on a NATS server of one's own.

Run it with the admin user's credentials (the services' users may not create or change streams: shared/streams.py)
whenever the server is new or the --queue-max-* limits change; it is idempotent. On Kubernetes it is the Job
specmesh-streams (k8s/base/nats/streams-job.yaml). `specmesh up` and `specmesh nats` do it for their own servers.
"""

from __future__ import annotations

import argparse
import sys

import nats.errors

from shared import nats_settings, option_types, stream_limits, streams
from shared.nats_roles import NatsRole
from shared.nats_settings import NatsSettings
from shared.stream_limits import StreamLimits


def add_arguments(parser: argparse.ArgumentParser) -> None:
    nats_settings.add_arguments(parser)
    stream_limits.add_arguments(parser)
    parser.add_argument(
        "--wait", type=option_types.seconds, default=streams.DEFAULT_DECLARE_TIMEOUT_S,
        help="seconds to wait for the server to come up",
    )


def run(args: argparse.Namespace) -> None:
    settings = NatsSettings.from_args(args, NatsRole.ADMIN)
    limits = StreamLimits.from_args(args)
    try:
        streams.declare_blocking(settings, limits, args.wait)
    except (TimeoutError, PermissionError, nats.errors.Error) as exc:
        raise SystemExit(f"specmesh streams: {args.nats_url}: {exc!r} (this needs the admin user's credentials)")
    print(f"specmesh streams: declared on {args.nats_url} with {limits.model_dump_json()}", file=sys.stderr)
