"""`specmesh`: start the whole mesh (`up`), one service, the embedded NATS server, or train the demo model."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import signal
import sys

# Each service module offers add_arguments(parser) and run(args); importing them lazily keeps
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
    "demo-model": "services.worker.demo_model.train",
}
HELP = {
    "up": "start NATS, a gateway, workers and a detokenizer; print the URL when the mesh answers",
    "gateway": "the OpenAI-compatible HTTP gateway",
    "worker": "a model worker (continuous batching, speculative decoding)",
    "detokenizer": "turns worker frames into text chunks",
    "nats": "the embedded NATS server with JetStream",
    "demo-model": "train the embedded demo model (deterministic; CPU)",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specmesh", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        sub.add_parser(name, help=HELP[name])
    return parser


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
    argv = sys.argv[1:] if argv is None else argv
    parser = _parser()
    top, rest = parser.parse_known_args(argv)
    logging.basicConfig(level=top.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    module = importlib.import_module(COMMANDS[top.command])
    sub = argparse.ArgumentParser(prog=f"specmesh {top.command}", description=HELP[top.command])
    module.add_arguments(sub)
    args = sub.parse_args(rest)
    result = module.run(args)
    if asyncio.iscoroutine(result):
        asyncio.run(_run_until_signalled(result))


if __name__ == "__main__":
    main()
