"""vLLM's `--seed`: the start of the stream that the seeds of sampled requests naming none are drawn from (an option
`specmesh up` takes too and hands on). Without it they come from the OS's entropy (shared/seeds.py SeedDraw)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--seed", type=int, default=None,
        help="start the stream the seeds of sampled requests that name none are drawn from: the same such requests, "
        "sent in the same order to a freshly started gateway, draw the same tokens (default: the OS's entropy)",
    )


def forwarded(args: argparse.Namespace) -> list[str]:
    """The option as the gateway's command line takes it."""
    return [] if args.seed is None else ["--seed", str(args.seed)]
