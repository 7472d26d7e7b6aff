"""`specmesh gateway`: command-line options and the process lifecycle of one gateway."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
from pathlib import Path

from aiohttp import web

from shared import option_types
from services.gateway import auth, limits, routing_options, seed_option, unknown_fields
from services.gateway.reasoning import options as reasoning_options
from services.gateway.tools import tool_options
from services.gateway.app import GATEWAY, GatewayConfig, create_app
from services.gateway.limits import GatewayLimits
from services.gateway.protocol import DEFAULT_MAX_N
from services.startup_checks import check_tokenizer_dir, context_length, resolve_max_model_len, speculative_config
from shared.config import DEFAULT_MODEL_DIR, SpeculativeConfig
from shared import nats_settings
from shared.nats_roles import NatsRole
from shared.nats_settings import NatsSettings
from shared.natsutil import connect
from shared.schemas import MAX_REQUEST_CHOICES

log = logging.getLogger(__name__)

SERVICE = "gateway"
SHUTDOWN_TIMEOUT_S = 30.0  # how long in-flight requests may finish once the gateway is told to stop
HANDLERS_END_S = 2.0  # then how long the handlers of the requests ended with a 503 have to write it


def add_arguments(parser: argparse.ArgumentParser) -> None:
    nats_settings.add_arguments(parser)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR, help="model directory (for the tokenizer)")
    parser.add_argument("--served-model-name", default=None, help="name clients use (default: the directory name)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=option_types.port, default=8000, help="HTTP port")
    parser.add_argument(
        "--max-model-len", type=int, default=None,
        help="prompt + generated tokens, at most (default: the model's max_position_embeddings)",
    )
    parser.add_argument(
        "--request-timeout", type=option_types.seconds, default=600.0,
        help="seconds without any output before a request fails"
    )
    parser.add_argument(
        "--max-n", type=option_types.between(1, MAX_REQUEST_CHOICES), default=DEFAULT_MAX_N,
        help="the most choices per prompt a request may ask for (`n`)",
    )
    parser.add_argument(
        "--shutdown-timeout", type=float, default=SHUTDOWN_TIMEOUT_S,
        help="seconds in-flight requests may finish after SIGTERM; the rest then end with a 503 (an error event in "
        "a stream) and are cancelled in the mesh",
    )
    parser.add_argument(
        "--speculative-config", type=speculative_config, default=None,
        help="the workers' speculative config (JSON): requests may ask for fewer drafts per step, never more",
    )
    seed_option.add_arguments(parser)
    limits.add_arguments(parser)
    auth.add_arguments(parser)
    routing_options.add_arguments(parser)
    unknown_fields.add_arguments(parser)
    tool_options.add_arguments(parser)
    reasoning_options.add_arguments(parser)


def resolve_args(args: argparse.Namespace) -> None:
    """--max-model-len defaults to the model's context length, and may not exceed it; the API keys are read."""
    check_tokenizer_dir(args.model)
    args.max_model_len = resolve_max_model_len(args.max_model_len, context_length(args.model), args.model)
    args.api_keys = auth.parse_api_keys(args.api_key, args.api_key_file, os.environ)


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    return GatewayConfig(
        model_dir=args.model,
        served_model_name=args.served_model_name or Path(args.model).name,
        max_model_len=args.max_model_len,
        request_timeout_s=args.request_timeout,
        max_n=args.max_n,
        speculative=SpeculativeConfig.from_json(args.speculative_config),
        limits=GatewayLimits.from_args(args),
        api_keys=args.api_keys,
        prefix_routing=args.prefix_routing,
        routing_busy_margin=args.routing_busy_margin,
        strict_params=args.strict_params,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        seed=args.seed,
    )


def _loopback(host: str) -> bool:
    """Whether only this machine can reach `host` (a name other than localhost counts as reachable)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def run(args: argparse.Namespace) -> None:
    """Serves until cancelled; then lets in-flight requests finish (up to --shutdown-timeout), ends the rest with a
    503, stops accepting, and drains NATS."""
    config = config_from_args(args)
    nc = await connect(NatsSettings.from_args(args, NatsRole.GATEWAY), SERVICE)
    try:
        app = create_app(config, nc)
        runner = web.AppRunner(
            app, handler_cancellation=True, shutdown_timeout=HANDLERS_END_S, **config.limits.runner_options()
        )
        await runner.setup()
        try:
            await web.TCPSite(runner, args.host, args.port).start()
            log.info("gateway serving %s on http://%s:%d", config.served_model_name, args.host, args.port)
            if not config.api_keys and not _loopback(args.host):
                log.warning(
                    "the gateway listens on %s with no API key: anyone who can reach it can use it (--api-key)",
                    args.host,
                )
            await asyncio.Event().wait()
        finally:
            await app[GATEWAY].drain(args.shutdown_timeout)
            await runner.cleanup()
    finally:
        await nc.drain()
