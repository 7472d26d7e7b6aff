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
from shared.natsutil import barrier, connect
from shared.schemas import Cancel, DetokOpen, DetokReady
from tests.gatewayfixture import MODEL, model_dir, nats_server, start_gateway
from tests.natsfixture import NatsServer

__all__ = ["model_dir", "nats_server"]  # fixtures, imported for pytest to find

WAIT_S = 5.0
LONG_WAIT_S = 60.0
KEYS = (SecretStr("sk-first"), SecretStr("sk-other"))


async def _holder(admission: Admission, key: str, order: list[str], release: asyncio.Event, weight: int = 1) -> None:
    async with admission.request(key) as places:
        await places.take(weight)
        order.append(key)
        await release.wait()


async def _enter_and_leave(admission: Admission, key: str, weight: int = 1) -> None:
    async with admission.request(key) as places:
        await places.take(weight)


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
        await _enter_and_leave(admission, "a")
    assert info.value.status == 429 and info.value.headers["Retry-After"]
    await _enter_and_leave(admission, "b")  # another client is not affected
    release.set()
    await asyncio.gather(*held)
    await _enter_and_leave(admission, "a")  # nor is this client once its streams ended


async def test_a_wait_is_bounded_and_a_leaver_frees_its_place() -> None:
    admission = Admission(max_in_flight=2, max_per_key=10, max_wait_s=0.2)
    release = asyncio.Event()
    order: list[str] = []
    holding = asyncio.create_task(_holder(admission, "a", order, release, weight=2))
    await _settle()
    with pytest.raises(OpenAIError) as info:  # nothing frees within max_wait_s
        await _enter_and_leave(admission, "b")
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
    async with admission.request("a") as places:
        await places.take(5)
        assert admission.in_flight == 5
    assert admission.in_flight == 0


async def test_a_request_of_many_prompts_shares_freed_slots_with_another_client() -> None:
    """A batch's prompts enter a slot at a time, taking turns with another client's request (submission.py)."""
    admission = Admission(max_in_flight=2, max_per_key=10, max_wait_s=LONG_WAIT_S)
    order: list[str] = []
    async with admission.request("batch") as batch:
        await batch.take(1)
        await batch.take(1)  # two of the batch's prompts fill the mesh
        third = asyncio.create_task(batch.take(1))
        await _settle()
        release = asyncio.Event()
        other = asyncio.create_task(_holder(admission, "other", order, release))
        await _settle()
        batch.give_back(1)  # the batch's first prompt ends: the other client's turn comes first
        await _settle()
        assert order == ["other"] and not third.done()
        batch.give_back(1)
        await _settle()
        assert third.done() and batch.held == 1
        release.set()
        await other
    assert admission.in_flight == 0


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


async def test_a_later_prompt_that_cannot_be_submitted_fails_the_response_and_frees_the_first(
    one_stream_gateway: TestServer, nats_server: NatsServer  # noqa: F811
) -> None:
    """A batch's prompts after the first are submitted while the answer runs (submission.py): one refused there
    still fails the whole response with its own error, and the prompts already in the mesh are cancelled."""
    peer = await connect(nats_server.settings(NatsRole.ADMIN), "test-detokenizer")
    opened: list[DetokOpen] = []
    cancels: asyncio.Queue[Cancel] = asyncio.Queue()

    async def take_one(msg) -> None:  # a detokenizer that takes the first prompt, then is gone
        opened.append(DetokOpen.from_bytes(msg.data))
        await taking.unsubscribe()
        await msg.respond(DetokReady(detok_id="test").to_bytes())

    async def on_cancel(msg) -> None:
        await cancels.put(Cancel.from_bytes(msg.data))

    taking = await peer.subscribe(subjects.DETOK_OPEN, cb=take_one)
    await peer.subscribe(subjects.CANCEL, cb=on_cancel)
    await barrier(peer)
    key = KEYS[0].get_secret_value()
    async with openai.AsyncOpenAI(base_url=str(one_stream_gateway.make_url("/v1")), api_key=key, max_retries=0) as c:
        with pytest.raises(openai.InternalServerError) as info:
            await asyncio.wait_for(c.completions.create(model=MODEL, prompt=["x", "y"], max_tokens=4), WAIT_S)
    assert info.value.status_code == 503 and "No detokenizer took the request" in info.value.body["message"]
    cancel = await asyncio.wait_for(cancels.get(), WAIT_S)
    assert [o.request_id for o in opened] == [cancel.request_id]
    await peer.drain()
