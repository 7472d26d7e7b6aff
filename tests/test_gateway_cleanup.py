"""What the gateway leaves in the mesh when a request ends early, and how it meets a full work queue: a real
gateway and a real nats-server, with the test playing the detokenizer."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import openai
import pytest
from nats.aio.client import Client
from nats.js.api import DiscardPolicy

from shared import subjects
from shared.nats_roles import NatsRole
from shared.natsutil import barrier, connect
from shared.schemas import Cancel, DetokOpen, DetokReady
from shared.stream_limits import StreamLimits
from tests.gatewayfixture import MODEL, gateway, model_dir, nats_server, start_gateway
from tests.natsfixture import NatsServer, running_nats_server

__all__ = ["gateway", "model_dir", "nats_server"]  # fixtures, imported for pytest to find

WAIT_S = 5.0
QUEUE_MAX_MSGS = 2


async def _detokenizer(nats: NatsServer, *, answer: bool) -> tuple[Client, asyncio.Queue[DetokOpen]]:
    """Plays the detokenizer: takes every DetokOpen, and answers it if `answer`."""
    nc = await connect(nats.settings(NatsRole.ADMIN), "test-detokenizer")
    opened: asyncio.Queue[DetokOpen] = asyncio.Queue()

    async def take(msg) -> None:
        await opened.put(DetokOpen.from_bytes(msg.data))
        if answer:
            await msg.respond(DetokReady(detok_id="test").to_bytes())

    await nc.subscribe(subjects.DETOK_OPEN, cb=take)
    await barrier(nc)
    return nc, opened


async def test_a_client_gone_while_the_detokenizer_answers_is_cancelled(
    gateway, nats_server: NatsServer  # noqa: F811
) -> None:
    detokenizer, opened = await _detokenizer(nats_server, answer=False)  # the answer is still on its way
    cancels = await detokenizer.subscribe(subjects.CANCEL)
    body = {"model": MODEL, "prompt": "x", "stream": True}
    async with aiohttp.ClientSession() as session:
        request = asyncio.create_task(session.post(gateway.make_url("/v1/completions"), json=body))
        opening = await asyncio.wait_for(opened.get(), WAIT_S)
        request.cancel()  # the client hangs up
        await asyncio.gather(request, return_exceptions=True)
    cancel = Cancel.from_bytes((await cancels.next_msg(timeout=WAIT_S)).data)
    assert cancel == Cancel(request_id=opening.request_id, reason="client_disconnected")
    await detokenizer.drain()


async def test_a_full_work_queue_answers_503_with_retry_after(model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    # A server of its own: the stream's limits are this test's.
    with running_nats_server(tmp_path / "nats", limits=StreamLimits(max_msgs=QUEUE_MAX_MSGS)) as nats:
        server, nc = await start_gateway(nats, model_dir)
        detokenizer, opened = await _detokenizer(nats, answer=True)
        try:
            async with openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="x", max_retries=0) as c:
                queued = []
                for _ in range(QUEUE_MAX_MSGS):  # no worker takes them: they fill the queue
                    queued.append(asyncio.create_task(c.completions.create(model=MODEL, prompt="x")))
                    await asyncio.wait_for(opened.get(), WAIT_S)
                with pytest.raises(openai.InternalServerError) as info:
                    await c.completions.create(model=MODEL, prompt="x")
                for call in queued:
                    call.cancel()
                await asyncio.gather(*queued, return_exceptions=True)
            assert info.value.status_code == 503 and info.value.response.headers["Retry-After"]
            assert "work queue is full" in info.value.body["message"]
            config = (await detokenizer.jetstream().stream_info(subjects.REQUEST_STREAM)).config  # as the admin
            assert config.max_msgs == QUEUE_MAX_MSGS and config.discard == DiscardPolicy.NEW
        finally:
            await detokenizer.drain()
            await server.close()
            await nc.drain()
