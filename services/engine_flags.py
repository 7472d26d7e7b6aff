"""Engine options that `specmesh up` and `specmesh worker` both take (vLLM's spellings accepted beside
specmesh's), and how the launcher hands them on to its workers."""

from __future__ import annotations

import argparse

from shared.config import EngineConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    default = EngineConfig.model_fields["enable_prefix_caching"].default
    parser.add_argument(
        "--enable-prefix-caching", dest="prefix_caching", action="store_true", default=default,
        help="keep computed prompt and output blocks for later requests that start the same way (the default)",
    )
    parser.add_argument(
        "--no-prefix-caching", "--no-enable-prefix-caching", dest="prefix_caching", action="store_false",
        help="compute every prompt from its first token",
    )


def forwarded(args: argparse.Namespace) -> list[str]:
    """The options as a worker's command line takes them."""
    return ["--enable-prefix-caching" if args.prefix_caching else "--no-prefix-caching"]
