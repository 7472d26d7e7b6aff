"""The real detokenizer service, run in the test's own event loop on a real nats-server, for tests that play the
gateways and workers around it (test_detokenizer_reaper.py, test_detokenizer_gateways.py)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from services.detokenizer import service
from shared.nats_roles import NatsRole
from tests.natsfixture import NatsServer

STARTUP_WAIT_S = 5.0
RETRY_S = 0.1


@contextlib.asynccontextmanager
async def detokenizer_service(
    nats_server: NatsServer, model_dir: Path, detok_id: str, *options: str
) -> AsyncIterator[None]:
    """The service with `options` beside the connection ones, until the block ends."""
    parser = argparse.ArgumentParser()
    service.add_arguments(parser)
    args = parser.parse_args([
        "--nats-url", nats_server.url, "--nats-credentials", str(nats_server.credentials_file(NatsRole.DETOKENIZER)),
        "--model", str(model_dir), "--metrics-port", "0", "--detokenizer-id", detok_id, *options,
    ])
    task = asyncio.create_task(service.run(args))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def until_it_answers(open_one: Callable[[], Awaitable[object]]) -> None:
    """Opens a request until the service answers (it subscribes once it has loaded its tokenizer)."""
    for _ in range(int(STARTUP_WAIT_S / RETRY_S)):
        with contextlib.suppress(Exception):
            await open_one()
            return
        await asyncio.sleep(RETRY_S)
