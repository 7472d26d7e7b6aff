"""Admission at the gateway: round robin between clients, a bound per client, bounded waits.

The Admission object itself under asyncio, then the 429 as a real gateway sends it to the real openai client.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import openai
import pytest
from aiohttp.test_utils import TestServer
from pydantic import SecretStr

from services.gateway.admission import Admission
from services.gateway.errors import OpenAIError
from services.gateway.limits import GatewayLimits
from shared import subjects
from shared.nats_roles import NatsRole
from shared.natsutil import connect
from shared.schemas import DetokOpen, DetokReady
from tests.gatewayfixture import MODEL, model_dir, nats_server, start_gateway
from tests.natsfixture import NatsServer

__all__ = ["model_dir", "nats_server"]  # fixtures, imported for pytest to find

WAIT_S = 5.0
LONG_WAIT_S = 60.0
KEYS = (SecretStr("sk-first"), SecretStr("sk-other"))


async def _holder(admission: Admission, key: str, order: list[str], release: asyncio.Event, weight: int = 1) -> None:
    async with admission.admit(key, weight):
        order.append(key)
        await release.wait()


async def _settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_freed_slots_go_round_robin_between_clients() -> None:
    admission = Admission(max_in_flight=1, max_per_key=10, max_wait_s=LONG_WAIT_S)
    order: list[str] = []
    releases = {name: asyncio.Event() for name in ("a0", "a1", "a2", "b0")}
    tasks = {}
    for name in ("a0", "a1", "a2", "b0"):  # client a queues three before client b's first arrives
        tasks[name] = asyncio.create_task(_holder(admission, name[0], order, releases[name]))
        await _settle()
    assert order == ["a"]
    for name in ("a0", "b0", "a1", "a2"):  # b's request is served before a's second and third
        releases[name].set()
        await tasks[name]
        await _settle()
    assert order == ["a", "b", "a", "a"]
    assert admission.in_flight == 0


async def test_a_client_past_its_limit_gets_429_at_once() -> None:
    admission = Admission(max_in_flight=None, max_per_key=2, max_wait_s=LONG_WAIT_S)
    release = asyncio.Event()
    held = [asyncio.create_task(_holder(admission, "a", [], release)) for _ in range(2)]
    await _settle()
    with pytest.raises(OpenAIError) as info:
        async with admission.admit("a", 1):
            pass
    assert info.value.status == 429 and info.value.headers["Retry-After"]
    async with admission.admit("b", 1):  # another client is not affected
        pass
    release.set()
    await asyncio.gather(*held)
    async with admission.admit("a", 1):  # nor is this client once its streams ended
        pass


async def test_a_wait_is_bounded_and_a_leaver_frees_its_place() -> None:
    admission = Admission(max_in_flight=2, max_per_key=10, max_wait_s=0.2)
    release = asyncio.Event()
    order: list[str] = []
    holding = asyncio.create_task(_holder(admission, "a", order, release, weight=2))
    await _settle()
    with pytest.raises(OpenAIError) as info:  # nothing frees within max_wait_s
        async with admission.admit("b", 1):
            pass
    assert info.value.status == 503 and info.value.headers["Retry-After"]
    leaver = asyncio.create_task(_holder(admission, "c", order, asyncio.Event()))
    stayer = asyncio.create_task(_holder(admission, "d", order, release))
    await _settle()
    leaver.cancel()  # its client hung up while waiting
    await asyncio.gather(leaver, return_exceptions=True)
    release.set()
    await asyncio.wait_for(asyncio.gather(holding, stayer), WAIT_S)
    assert order == ["a", "d"] and admission.in_flight == 0


async def test_a_request_heavier_than_the_bound_runs_alone() -> None:
    admission = Admission(max_in_flight=2, max_per_key=10, max_wait_s=WAIT_S)
    async with admission.admit("a", 5):
        assert admission.in_flight == 5


@pytest.fixture
async def one_stream_gateway(nats_server: NatsServer, model_dir) -> AsyncIterator[TestServer]:  # noqa: F811
    """A gateway that checks two keys and lets each client hold one stream."""
    limits = GatewayLimits(max_concurrent_per_key=1)
    server, nc = await start_gateway(nats_server, model_dir, limits=limits, api_keys=KEYS)
    yield server
    await server.close()
    await nc.drain()


async def test_gateway_answers_429_per_key_with_an_openai_error_body(
    one_stream_gateway: TestServer, nats_server: NatsServer  # noqa: F811
) -> None:
    peer = await connect(nats_server.settings(NatsRole.ADMIN), "test-detokenizer")
    opened: asyncio.Queue[DetokOpen] = asyncio.Queue()

    async def answer(msg) -> None:  # a detokenizer that takes the request and never sends a chunk
        await opened.put(DetokOpen.from_bytes(msg.data))
        await msg.respond(DetokReady(detok_id="test").to_bytes())

    await peer.subscribe(subjects.DETOK_OPEN, cb=answer)
    base_url = str(one_stream_gateway.make_url("/v1"))
    first_key, other_key = (key.get_secret_value() for key in KEYS)
    client = openai.AsyncOpenAI(base_url=base_url, api_key=first_key, max_retries=0)
    other = openai.AsyncOpenAI(base_url=base_url, api_key=other_key, max_retries=0)  # same address, another key
    async with client, other:
        held = [
            asyncio.create_task(c.completions.create(model=MODEL, prompt="x", max_tokens=4)) for c in (client, other)
        ]
        for _ in held:
            await asyncio.wait_for(opened.get(), WAIT_S)  # each key's one stream is admitted
        with pytest.raises(openai.RateLimitError) as info:
            await client.completions.create(model=MODEL, prompt="x", max_tokens=4)
        for call in held:
            call.cancel()
        await asyncio.gather(*held, return_exceptions=True)
    error = info.value.body
    assert error["code"] == "rate_limit_exceeded" and "at most 1" in error["message"]
    assert info.value.response.headers["Retry-After"]
    await peer.drain()
