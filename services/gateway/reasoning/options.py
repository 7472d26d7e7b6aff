"""--reasoning-parser, on `specmesh gateway` and `specmesh up` (which hands it on): vLLM's option and parser names."""

from __future__ import annotations

import argparse

from services.gateway.reasoning.parser import FORMATS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--reasoning-parser", choices=sorted(FORMATS), default=None,
        help="set a reasoning model's thinking apart from its chat answers, as `reasoning` (and "
        "`reasoning_content`): qwen3 (an answer may open with a <think> block), deepseek_r1 (the prompt opens "
        "it), mistral (Magistral's [THINK] block), seed_oss (<seed:think>). Without it the block stays in the "
        "content",
    )


def forwarded(args: argparse.Namespace) -> list[str]:
    return [] if args.reasoning_parser is None else ["--reasoning-parser", args.reasoning_parser]
