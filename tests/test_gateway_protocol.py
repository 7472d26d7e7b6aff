"""The gateway's side of the mesh protocol, with the test playing detokenizer and worker over real NATS.

The peer takes the DetokOpen and the WorkRequest exactly as a detokenizer and a worker would, and answers
with scripted Chunks; the real `openai` client reads the result. This pins the wire order, the SSE shape,
aggregation, and the Cancel the gateway publishes when a request ends early.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest
from aiohttp.test_utils import TestServer
from tests.gatewayfixture import MODEL, client, gateway, model_dir, nats_server, start_gateway
from tests.natsfixture import NatsServer
from nats.aio.client import Client

from shared import subjects
from shared.nats_roles import NatsRole
from shared.natsutil import connect
from services.gateway.liveness import CHECK_AFTER_S
from shared.seeds import SeedDraw
from shared.schemas import Cancel, Chunk, DetokOpen, DetokReady, HeldQuery, HeldReport, Usage, WorkRequest

__all__ = ["client", "gateway", "model_dir", "nats_server"]  # fixtures, imported for pytest to find

WAIT_S = 5.0
PEER_ID = "test-peer"
SHORT_TIMEOUT_S = 0.5
USAGE = Usage(prompt_tokens=5, completion_tokens=3, total_tokens=8)
CHAT = [{"role": "user", "content": "hello"}]


def _entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []}


class Peer:
    """Takes requests off the mesh like a detokenizer plus a worker, and answers them with given choices."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc

    async def start(self) -> None:
        self.opens = await self.nc.subscribe(subjects.DETOK_OPEN)
        self.cancels = await self.nc.subscribe(subjects.CANCEL)
        self.work = await self.nc.jetstream().pull_subscribe_bind(
            durable=subjects.WORKER_CONSUMER, stream=subjects.REQUEST_STREAM
        )

    async def take(self) -> tuple[DetokOpen, WorkRequest]:
        msg = await self.opens.next_msg(timeout=WAIT_S)
        opening = DetokOpen.from_bytes(msg.data)
        await msg.respond(DetokReady(detok_id=PEER_ID).to_bytes())
        while True:  # requests left by earlier tests that nobody answered are skipped
            (msg,) = await self.work.fetch(1, timeout=WAIT_S)
            await msg.ack()
            work = WorkRequest.from_bytes(msg.data)
            if work.request_id == opening.request_id:
                return opening, work

    async def reply(self, opening: DetokOpen, choices: list[dict], *, first_seq: int = 0, error: str | None = None):
        for i, choice in enumerate(choices):
            last = i == len(choices) - 1
            chunk = Chunk(
                request_id=opening.request_id,
                seq=first_seq + i,
                final=last,
                choice=choice,
                usage=USAGE if last and error is None else None,
                error=error if last else None,
            )
            await self.nc.publish(opening.reply_subject, chunk.to_bytes())

    async def cancelled(self) -> Cancel:
        return Cancel.from_bytes((await self.cancels.next_msg(timeout=WAIT_S)).data)


@pytest.fixture
async def peer(nats_server: NatsServer) -> AsyncIterator[Peer]:  # noqa: F811
    nc = await connect(nats_server.settings(NatsRole.ADMIN), "test-peer")  # it plays two roles
    peer = Peer(nc)
    await peer.start()
    yield peer
    await nc.drain()


def _chat_choice(text: str, finish: str | None, entries: list[dict], drafts: list[dict]) -> dict:
    return {
        "index": 0,
        "delta": {"content": text},
        "logprobs": {"content": entries},
        "finish_reason": finish,
        "draft_logprobs": {"content": drafts},
    }


async def test_chat_request_reaches_the_mesh_and_is_aggregated(client: openai.AsyncOpenAI, peer: Peer) -> None:
    call = asyncio.create_task(
        client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            logprobs=True,
            top_logprobs=2,
            seed=7,
            extra_body={"include_draft_logprobs": True},
        )
    )
    opening, work = await peer.take()
    assert opening.api == "chat" and opening.logprobs == 2 and opening.include_draft_logprobs
    assert work.sampling.logprobs == 2 and work.sampling.seed == 7 and work.sampling.include_draft_logprobs
    assert opening.num_prompt_tokens == len(work.prompt_token_ids)
    drafted = {**_entry("lo", 0.0), "accepted": True}
    await peer.reply(
        opening,
        [
            _chat_choice("Hel", None, [_entry("Hel", -0.5)], []),
            _chat_choice("lo", "stop", [_entry("lo", -0.1)], [drafted]),
        ],
    )
    result = await call
    assert result.id == f"chatcmpl-{opening.request_id}" and result.object == "chat.completion"
    choice = result.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == "Hello"
    assert choice.finish_reason == "stop"
    assert [e.token for e in choice.logprobs.content] == ["Hel", "lo"]
    assert choice.model_extra["draft_logprobs"] == {"content": [drafted]}
    assert result.usage.total_tokens == USAGE.total_tokens


async def test_completion_stream_with_usage(client: openai.AsyncOpenAI, peer: Peer) -> None:
    async def read() -> list:
        stream = await client.completions.create(
            model=MODEL, prompt="def f(x):", max_tokens=3, stream=True, stream_options={"include_usage": True}
        )
        return [event async for event in stream]

    call = asyncio.create_task(read())
    opening, work = await peer.take()
    assert opening.api == "completion" and opening.logprobs is None and work.sampling.max_tokens == 3
    texts = ["\n  ", "return", " x"]
    finishes = [None, None, "length"]
    choices = [{"index": 0, "text": t, "logprobs": None, "finish_reason": f} for t, f in zip(texts, finishes)]
    await peer.reply(opening, choices)
    events = await call
    assert [e.choices[0].text for e in events[:-1]] == texts
    assert events[-2].choices[0].finish_reason == "length"
    assert events[-1].choices == [] and events[-1].usage.completion_tokens == USAGE.completion_tokens
    assert all(e.id == f"cmpl-{opening.request_id}" and e.object == "text_completion" for e in events)
    assert all(e.usage is None for e in events[:-1])


async def test_chat_stream_starts_with_the_role(client: openai.AsyncOpenAI, peer: Peer) -> None:
    async def read() -> list:
        stream = await client.chat.completions.create(model=MODEL, messages=CHAT, stream=True)
        return [event async for event in stream]

    call = asyncio.create_task(read())
    opening, _ = await peer.take()
    await peer.reply(opening, [{"index": 0, "delta": {"content": "hi"}, "logprobs": None, "finish_reason": "stop"}])
    events = await call
    assert events[0].choices[0].delta.role == "assistant" and events[0].choices[0].delta.content == ""
    assert events[1].choices[0].delta.content == "hi" and events[1].choices[0].finish_reason == "stop"
    assert all(e.object == "chat.completion.chunk" for e in events)


async def test_error_chunk_is_a_500_without_cancel(client: openai.AsyncOpenAI, peer: Peer) -> None:
    call = asyncio.create_task(client.completions.create(model=MODEL, prompt="x"))
    opening, _ = await peer.take()
    await peer.reply(opening, [{"index": 0, "text": "", "logprobs": None, "finish_reason": None}], error="worker lost")
    with pytest.raises(openai.InternalServerError) as info:
        await call
    assert "worker lost" in info.value.body["message"]
    with pytest.raises(TimeoutError):
        await peer.cancels.next_msg(timeout=SHORT_TIMEOUT_S)


async def test_lost_chunk_fails_the_stream_and_cancels(client: openai.AsyncOpenAI, peer: Peer) -> None:
    async def read() -> list:
        stream = await client.completions.create(model=MODEL, prompt="x", stream=True)
        return [event async for event in stream]

    call = asyncio.create_task(read())
    opening, _ = await peer.take()
    await peer.reply(opening, [{"index": 0, "text": "a", "logprobs": None, "finish_reason": None}], first_seq=1)
    with pytest.raises(openai.APIError, match="lost"):
        await call
    assert await peer.cancelled() == Cancel(request_id=opening.request_id, reason="error")


async def test_client_disconnect_cancels(gateway: TestServer, peer: Peer) -> None:
    body = {"model": MODEL, "messages": CHAT, "stream": True}
    taken = asyncio.create_task(peer.take())  # answers the gateway's DetokOpen, as a detokenizer does
    async with aiohttp.ClientSession() as session:
        response = await session.post(gateway.make_url("/v1/chat/completions"), json=body)
        assert response.headers["Content-Type"] == "text/event-stream"
        assert response.headers["Cache-Control"] == "no-cache"
        assert (await response.content.readline()).startswith(b"data: ")  # the role chunk
        opening, _ = await taken
        response.close()
    assert await peer.cancelled() == Cancel(request_id=opening.request_id, reason="client_disconnected")


async def test_silence_times_out_and_cancels(nats_server: NatsServer, model_dir, peer: Peer) -> None:  # noqa: F811
    server, nc = await start_gateway(nats_server, model_dir, request_timeout_s=SHORT_TIMEOUT_S)
    try:
        taken = asyncio.create_task(peer.take())
        async with openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="x", max_retries=0) as c:
            with pytest.raises(openai.APIStatusError) as info:
                await c.completions.create(model=MODEL, prompt="x")
        assert info.value.status_code == 504
        opening, _ = await taken
        assert await peer.cancelled() == Cancel(request_id=opening.request_id, reason="error")
    finally:
        await server.close()
        await nc.drain()


@pytest.mark.exclusive  # bounds a time: alone, not beside another worker's tests (tests/conftest.py)
async def test_a_request_whose_detokenizer_is_gone_ends_within_seconds(client: openai.AsyncOpenAI, peer: Peer) -> None:
    taken = asyncio.create_task(peer.take())  # answers as detokenizer PEER_ID, then never again: it "died"
    started = asyncio.get_running_loop().time()
    with pytest.raises(openai.APIStatusError) as info:
        await client.completions.create(model=MODEL, prompt="x")
    opening, _ = await taken
    assert info.value.status_code == 502
    assert f"the detokenizer {PEER_ID} that held the request is gone" in str(info.value)
    assert asyncio.get_running_loop().time() - started < CHECK_AFTER_S + WAIT_S
    assert await peer.cancelled() == Cancel(request_id=opening.request_id, reason="error")


async def test_a_request_its_detokenizer_no_longer_holds_ends(client: openai.AsyncOpenAI, peer: Peer) -> None:
    async def holds_nothing(msg) -> None:  # alive, but the request's last chunks were lost on the way
        await msg.respond(HeldReport().to_bytes())

    held = await peer.nc.subscribe(subjects.held(PEER_ID), cb=holds_nothing)
    try:
        taken = asyncio.create_task(peer.take())
        with pytest.raises(openai.APIStatusError) as info:
            await client.completions.create(model=MODEL, prompt="x")
        opening, _ = await taken
    finally:
        await held.unsubscribe()
    assert info.value.status_code == 502 and "no longer holds request" in str(info.value)
    assert await peer.cancelled() == Cancel(request_id=opening.request_id, reason="error")


async def test_a_silent_request_its_detokenizer_holds_goes_on(client: openai.AsyncOpenAI, peer: Peer) -> None:
    async def holds_all(msg) -> None:
        await msg.respond(HeldReport(request_ids=HeldQuery.from_bytes(msg.data).request_ids).to_bytes())

    held = await peer.nc.subscribe(subjects.held(PEER_ID), cb=holds_all)
    try:
        call = asyncio.create_task(client.completions.create(model=MODEL, prompt="x"))
        opening, _ = await peer.take()
        await asyncio.sleep(2 * CHECK_AFTER_S)  # silent, as a request waiting in the work queue is
        await peer.reply(opening, [{"index": 0, "text": "late", "logprobs": None, "finish_reason": "length"}])
        assert (await call).choices[0].text == "late"
    finally:
        await held.unsubscribe()


async def test_a_gateway_seed_fixes_the_seeds_of_unseeded_sampled_requests(
    nats_server: NatsServer, model_dir, peer: Peer  # noqa: F811
) -> None:
    """vLLM's --seed: unseeded sampled requests draw their seeds, in arrival order, from the stream it starts (so a
    restarted gateway sent them again draws the same tokens); greedy and seeded requests take none from it."""
    server, nc = await start_gateway(nats_server, model_dir, seed=1234)
    stream = SeedDraw(1234)
    try:
        async with openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="x", max_retries=0) as c:
            for request, expected in (
                ({"temperature": 1.0}, stream.draw()),
                ({"temperature": 0.0}, None),
                ({"temperature": 1.0, "seed": 5}, 5),
                ({"temperature": 0.7}, stream.draw()),
            ):
                call = asyncio.create_task(c.completions.create(model=MODEL, prompt="x", max_tokens=2, **request))
                opening, work = await peer.take()
                assert work.sampling.seed == expected, request
                await peer.reply(opening, [{"index": 0, "text": "ok", "finish_reason": "stop"}])
                await call
    finally:
        await server.close()
        await nc.drain()


async def test_the_gateway_tells_a_detokenizer_which_requests_it_still_waits_for(
    client: openai.AsyncOpenAI, peer: Peer
) -> None:
    """The question a detokenizer asks every few seconds, so that the requests of a gateway gone are stopped
    (services/detokenizer/gateways.py): an open request is held, one that ended or was never opened is not."""
    call = asyncio.create_task(client.completions.create(model=MODEL, prompt="x", max_tokens=2))
    opening, _ = await peer.take()
    never = "0" * 32
    held_subject = f"{opening.reply_subject}.held"  # subjects.gateway_held(the gateway's id)
    query = HeldQuery(request_ids=(opening.request_id, never)).to_bytes()
    reply = await peer.nc.request(held_subject, query, timeout=WAIT_S)
    assert HeldReport.from_bytes(reply.data).request_ids == (opening.request_id,)
    await peer.reply(opening, [{"index": 0, "text": "ok", "finish_reason": "stop"}])
    await call
    reply = await peer.nc.request(held_subject, query, timeout=WAIT_S)
    assert HeldReport.from_bytes(reply.data).request_ids == ()
