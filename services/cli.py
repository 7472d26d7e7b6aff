"""`specmesh`: start the whole mesh (`up`), one service, the embedded NATS server, or train the demo model."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import signal
import sys
from types import ModuleType
from typing import NoReturn

from pydantic import ValidationError

from services.startup_checks import UsageError

# Each command's module offers add_arguments(parser) and run(args), and may offer resolve_args(args), which checks
# the options against the model and fills the defaults that depend on it. Importing the modules lazily keeps
# `specmesh gateway` from loading torch.
SERVICES = {
    "gateway": "services.gateway.service",
    "worker": "services.worker.service",
    "detokenizer": "services.detokenizer.service",
}
COMMANDS = {
    **SERVICES,
    "up": "services.launcher",
    "nats": "services.embedded_nats",
    "streams": "services.declare_streams",
    "demo-model": "services.worker.demo_model.train",
}
HELP = {
    "up": "start NATS, a gateway, workers and a detokenizer; print the URL when the mesh answers",
    "gateway": "the OpenAI-compatible HTTP gateway",
    "worker": "a model worker (continuous batching, speculative decoding)",
    "detokenizer": "turns worker frames into text chunks",
    "nats": "the embedded NATS server with JetStream",
    "streams": "declare the mesh's streams on a NATS server of your own (admin credentials)",
    "demo-model": "train the embedded demo model (deterministic; CPU)",
}
USAGE_ERROR = 2  # argparse's exit status for a command line it refuses
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
DEFAULT_LOG_LEVEL = "INFO"
VALUE_ERROR_PREFIX = "Value error, "  # pydantic's, on the message of a ValueError a validator raised
LOG_LEVEL_HELP = f"logging threshold (default {DEFAULT_LOG_LEVEL}); also accepted before the command"


class CommandLineParser(argparse.ArgumentParser):
    """An argparse parser that reports a bad command line in one line on stderr, with exit status 2."""

    def error(self, message: str) -> NoReturn:
        one_line = " ".join(message.split())
        self.exit(USAGE_ERROR, f"{self.prog}: error: {one_line} (see {self.prog} --help)\n")


class DefaultsFormatter(argparse.HelpFormatter):
    """Shows each option's default after its help, unless the help already speaks of it or there is none to show
    (an on/off flag's: "--no-x (default: True)" would read as if the flag were on)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        flag = isinstance(action.default, bool)
        if action.option_strings and not flag and action.default not in (None, argparse.SUPPRESS) \
                and "default" not in text:
            text += " (default: %(default)s)"
        return text


def top_parser() -> CommandLineParser:
    """`specmesh [--log-level L] <command> ...`: the command's own options are left to command_parser, so that
    `specmesh <command> --help` shows them and only the command's module is imported."""
    parser = CommandLineParser(
        prog="specmesh", description=__doc__, epilog="`specmesh <command> --help` lists the options of a command."
    )
    parser.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default=None, help=LOG_LEVEL_HELP)
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    for name in COMMANDS:
        sub.add_parser(name, help=HELP[name], add_help=False)
    return parser


def command_parser(command: str, module: ModuleType) -> CommandLineParser:
    parser = CommandLineParser(
        prog=f"specmesh {command}", description=HELP[command], formatter_class=DefaultsFormatter
    )
    module.add_arguments(parser)
    parser.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default=None, help=LOG_LEVEL_HELP)
    return parser


def parse(argv: list[str], resolve: bool = True) -> tuple[ModuleType, argparse.Namespace]:
    """The command's module and its options, exactly as `specmesh argv` would run them. With resolve, the options
    are also checked against the model (which must then be present); a refusal exits with status 2."""
    top, rest = top_parser().parse_known_args(argv)
    module = importlib.import_module(COMMANDS[top.command])
    parser = command_parser(top.command, module)
    args = parser.parse_args(rest)
    args.log_level = args.log_level or top.log_level or DEFAULT_LOG_LEVEL
    resolve_args = getattr(module, "resolve_args", None)
    if resolve and resolve_args is not None:
        try:
            resolve_args(args)
        except UsageError as exc:
            parser.error(str(exc))
        except ValidationError as exc:  # an option a config model bounds (EngineConfig's max_model_len >= 16, ...)
            parser.error(_option_error(exc))
    return module, args


def _option_error(exc: ValidationError) -> str:
    """A config model's refusal in the words of the option that gave the value (its field's name, dashed), or, for
    options that do not go together (a check of the whole model), its own message."""
    error = exc.errors()[0]
    message = error["msg"].removeprefix(VALUE_ERROR_PREFIX)
    if not error["loc"]:
        return message
    return f"--{str(error['loc'][0]).replace('_', '-')}: {message}, got {error.get('input')!r}"


async def _run_until_signalled(coro) -> None:
    """Runs a service until SIGTERM or SIGINT, then cancels it so it can drain."""
    task = asyncio.ensure_future(coro)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    try:
        await task
    except asyncio.CancelledError:
        pass


def main(argv: list[str] | None = None) -> None:
    module, args = parse(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    result = module.run(args)
    if asyncio.iscoroutine(result):
        asyncio.run(_run_until_signalled(result))


if __name__ == "__main__":
    main()
