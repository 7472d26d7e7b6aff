"""--tool-call-parser, on `specmesh gateway` and `specmesh up` (which hands it on): the format the model writes tool
calls in (tools/formats.py), vLLM's option name; auto reads it off the chat template."""

from __future__ import annotations

import argparse

from services.gateway.tools.formats import FORMAT_NAMES

AUTO = "auto"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tool-call-parser", choices=[AUTO, *FORMAT_NAMES], default=AUTO,
        help="how the model writes tool calls: hermes (<tool_call> JSON blocks: Qwen2.5, Qwen3, the demo model), "
        "llama3_json (one JSON call with parameters: Llama 3.x), mistral (after [TOOL_CALLS]: Mistral), granite "
        "(after <|tool_call|>: Granite 3.x), qwen3_coder (<tool_call> XML blocks: Qwen3-Coder) or seed_oss "
        "(<seed:tool_call> blocks: Seed-OSS); auto reads it off the chat template",
    )
    # vLLM serves tool_choice "auto" only with this flag; here it is always served, so a vLLM command line runs as is
    parser.add_argument(
        "--enable-auto-tool-choice", action="store_true",
        help="vLLM's switch for tool_choice \"auto\", accepted as is: auto is always served here",
    )


def forwarded(args: argparse.Namespace) -> list[str]:
    return ["--tool-call-parser", args.tool_call_parser]
