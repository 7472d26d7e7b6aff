"""The detokenizer service: frames from workers in, OpenAI-shaped chunks to the owning gateway out.

This module starts the process: its options, the NATS subscriptions of the handlers in handlers.py, and the drain
on shutdown.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
import uuid
from pathlib import Path

from shared import option_types
from services.detokenizer import gateways
from services.detokenizer.handlers import Detokenizer
from services.detokenizer.incremental import TokenTable
from services.detokenizer.migration import DEFAULT_MAX_MIGRATIONS, max_migrations_arg
from services.detokenizer.reaper import DEFAULT_IDLE_TIMEOUT_S
from services.startup_checks import check_tokenizer_dir
from shared import config, nats_settings, natsutil, subjects
from shared.nats_roles import NatsRole
from shared.nats_settings import NatsSettings
from shared.observability import Readiness, start_http
from shared.tokenizer import Tokenizer
from shared.natsutil import core_only

log = logging.getLogger(__name__)

SERVICE = "detokenizer"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    nats_settings.add_arguments(parser)
    parser.add_argument(
        "--model", type=Path, default=config.DEFAULT_MODEL_DIR, help="model directory holding tokenizer.json"
    )
    parser.add_argument("--metrics-host", default="127.0.0.1", help="address of /metrics, /health and /ready")
    parser.add_argument(
        "--metrics-port", type=option_types.port_or_any, default=9101,
        help="/metrics, /health and /ready; 0 picks one",
    )
    parser.add_argument("--drain-timeout", type=float, default=60.0, help="seconds open requests may finish on SIGTERM")
    parser.add_argument("--detokenizer-id", default=None, help="names this instance's frames subject (default: random)")
    parser.add_argument(
        "--idle-request-timeout", type=float, default=DEFAULT_IDLE_TIMEOUT_S,
        help="seconds an open request may go without a frame before it is closed (keep above the gateway's "
        "--request-timeout)",
    )
    parser.add_argument(
        "--max-migrations", type=max_migrations_arg, default=DEFAULT_MAX_MIGRATIONS,
        help="times a request may be taken over by another worker after losing its own; past that it ends with an "
        "error",
    )
    parser.add_argument(
        "--gateway-check-interval", type=option_types.non_negative_seconds, default=gateways.DEFAULT_CHECK_INTERVAL_S,
        help="seconds between asking the gateways which open requests they still wait for: those of a gateway gone "
        "(killed; unanswered at two checks in a row) are stopped at the workers; 0: never asked (while gateways "
        "from before this check still run)",
    )


def resolve_args(args: argparse.Namespace) -> None:
    check_tokenizer_dir(args.model)


async def run(args: argparse.Namespace) -> None:
    """Serves until cancelled; then reports not ready, lets open requests finish, and drains NATS."""
    readiness = Readiness()
    http = await start_http(readiness, args.metrics_host, args.metrics_port)
    table = TokenTable.from_tokenizer(Tokenizer(args.model))
    reconnected = asyncio.Event()
    settings = NatsSettings.from_args(args, NatsRole.DETOKENIZER)
    nc = await natsutil.connect(settings, SERVICE, on_reconnect=reconnected.set)
    readiness.nc = nc
    detok = Detokenizer(
        nc, table, args.detokenizer_id or uuid.uuid4().hex[:12], args.idle_request_timeout, args.max_migrations
    )
    await nc.subscribe(subjects.frames(detok.detok_id), cb=core_only(detok.on_frame))
    await nc.subscribe(subjects.progress(detok.detok_id), cb=core_only(detok.on_progress))
    await nc.subscribe(subjects.held(detok.detok_id), cb=core_only(detok.on_held))
    await nc.subscribe(subjects.CANCEL, cb=core_only(detok.on_cancel))
    opens = await nc.subscribe(subjects.DETOK_OPEN, queue=subjects.DETOK_QUEUE, cb=core_only(detok.on_open))
    reaping = asyncio.create_task(detok.reap_loop())
    checking = asyncio.create_task(detok.gateway_check_loop(args.gateway_check_interval)) \
        if args.gateway_check_interval else None
    watching = asyncio.create_task(detok.watch_reconnects(reconnected))
    try:
        # Subscriptions are registered at the server only once it has read them; callers may publish right after.
        await natsutil.barrier(nc)
        readiness.started = True
        log.info("detokenizer serving on %s", args.nats_url)
        await asyncio.Future()
    except asyncio.CancelledError:
        readiness.draining = True
        await opens.unsubscribe()  # new requests go to the other detokenizers
        deadline = time.monotonic() + args.drain_timeout
        while detok.num_active and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
    finally:
        reaping.cancel()
        if checking is not None:
            checking.cancel()
        watching.cancel()
        await nc.drain()
        await http.cleanup()
