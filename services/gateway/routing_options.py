"""The gateway's prefix-aware routing options, which `specmesh up` takes too and hands on."""

from __future__ import annotations

import argparse

from shared.prefix_router import DEFAULT_BUSY_MARGIN


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prefix-routing", dest="prefix_routing", action="store_true", default=True,
        help="send each request to the worker whose prefix cache holds the longest part of its prompt (the default)",
    )
    parser.add_argument(
        "--no-prefix-routing", dest="prefix_routing", action="store_false",
        help="send every request to the shared queue, which whichever worker asks first takes from",
    )
    parser.add_argument(
        "--routing-busy-margin", type=_margin, default=DEFAULT_BUSY_MARGIN,
        help="how many more sequences than the least busy worker the worker holding a prompt's prefix may hold "
        "and still get it",
    )


def _margin(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {text}")
    return value


def forwarded(args: argparse.Namespace) -> list[str]:
    """The options as the gateway's command line takes them."""
    return [
        "--prefix-routing" if args.prefix_routing else "--no-prefix-routing",
        "--routing-busy-margin", str(args.routing_busy_margin),
    ]
