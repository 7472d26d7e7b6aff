"""Size and time limits at the gateway, checked before anything costly: a real gateway on a real port, spoken to
over raw sockets where a client must misbehave, and through the real openai client otherwise."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import openai
import pytest
from aiohttp.test_utils import TestServer

from services.gateway.limits import GatewayLimits
from shared import subjects
from shared.nats_roles import NatsRole
from shared.natsutil import connect
from shared.schemas import Cancel, DetokOpen, DetokReady
from tests.gatewayfixture import MODEL, VOCAB_SIZE, client, gateway, model_dir, nats_server, start_gateway
from tests.natsfixture import NatsServer

__all__ = ["client", "gateway", "model_dir", "nats_server"]  # fixtures, imported for pytest to find

SHORT_S = 0.5  # the idle and body timeouts of the gateway under test
WAIT_S = 5.0
HUGE_BODIES = 8
HUGE_CHAT_CHARS = 3_400_000
HUGE_SEND_S = 0.2
HUGE_ANSWER_S = 3.0
LONG_CONTEXT = 1_000_000  # positions of a model whose prompts can outgrow a NATS message
OVERSIZED_PROMPT_TOKENS = 300_000  # ~1.2 MB of token ids in the work request, past NATS's default 1 MiB


@pytest.fixture(scope="module")
async def strict_gateway(nats_server: NatsServer, model_dir: Path) -> AsyncIterator[TestServer]:  # noqa: F811
    limits = GatewayLimits(idle_timeout_s=SHORT_S, body_timeout_s=SHORT_S)
    server, nc = await start_gateway(nats_server, model_dir, limits=limits)
    yield server
    await server.close()
    await nc.drain()


async def _connect(server: TestServer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(server.host, server.port)


async def _closed_within(reader: asyncio.StreamReader, seconds: float) -> bytes:
    """Everything the server sends until it closes the connection, which must happen within `seconds`."""
    return await asyncio.wait_for(reader.read(), seconds)


async def test_a_silent_connection_is_closed(strict_gateway: TestServer) -> None:
    reader, writer = await _connect(strict_gateway)
    started = time.monotonic()
    assert await _closed_within(reader, WAIT_S) == b""
    assert time.monotonic() - started >= SHORT_S
    writer.close()


async def test_an_idle_keep_alive_connection_is_closed(strict_gateway: TestServer) -> None:
    reader, writer = await _connect(strict_gateway)
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    started = time.monotonic()
    assert (await _closed_within(reader, WAIT_S)).startswith(b"HTTP/1.1 200")
    assert time.monotonic() - started >= SHORT_S
    writer.close()


async def test_slow_headers_are_cut_off(strict_gateway: TestServer) -> None:
    reader, writer = await _connect(strict_gateway)
    started = time.monotonic()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    closed = asyncio.create_task(_closed_within(reader, WAIT_S))
    while not closed.done() and time.monotonic() - started < WAIT_S:
        writer.write(b"X-Slow: y\r\n")  # a header line now and then, never the blank line that ends them
        await asyncio.sleep(SHORT_S / 5)
    assert await closed == b""
    writer.close()


async def test_a_slow_body_gets_408_and_a_closing_connection(strict_gateway: TestServer) -> None:
    reader, writer = await _connect(strict_gateway)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    )
    status = asyncio.create_task(asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S))
    while not status.done():
        writer.write(b" ")  # one byte at a time, far slower than the body timeout allows for 1000
        await asyncio.sleep(SHORT_S / 5)
    head = (await status).decode().lower()
    assert head.startswith("http/1.1 408") and "connection: close" in head
    length = int(head.split("content-length: ")[1].split("\r\n")[0])
    assert json.loads(await reader.readexactly(length))["error"]["type"] == "timeout_error"
    writer.close()


async def test_a_declared_oversized_body_is_refused_unread(gateway: TestServer) -> None:
    reader, writer = await _connect(gateway)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50000000\r\n\r\n")  # and no body
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
    assert head.startswith(b"HTTP/1.1 413")
    writer.close()


@pytest.mark.exclusive  # bounds a time: alone, not beside another worker's tests (tests/conftest.py)
async def test_huge_prompts_are_refused_before_tokenizing(gateway: TestServer) -> None:
    url = str(gateway.make_url("/v1/chat/completions"))
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x = 1\n" * (HUGE_CHAT_CHARS // 6)}]})

    async def post(session: aiohttp.ClientSession) -> tuple[int, dict]:
        async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as response:
            return response.status, await response.json()

    async def small(session: aiohttp.ClientSession) -> float:
        await asyncio.sleep(HUGE_SEND_S)  # once the huge bodies are on their way
        started = time.monotonic()
        async with session.get(gateway.make_url("/v1/models")) as response:
            assert response.status == 200
        return time.monotonic() - started

    started = time.monotonic()
    async with aiohttp.ClientSession() as session:
        *answers, small_s = await asyncio.gather(*(post(session) for _ in range(HUGE_BODIES)), small(session))
    all_s = time.monotonic() - started
    for status, error in answers:
        assert status == 400 and error["error"]["code"] == "context_length_exceeded"
        assert error["error"]["param"] == "messages"
    # Tokenizing one of these bodies takes about 11 s on a 2-core machine; reading and refusing all eight, well
    # under a second.
    assert all_s < HUGE_ANSWER_S and small_s < HUGE_ANSWER_S, (all_s, small_s)


async def test_an_overlong_stop_string_is_refused(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await client.completions.create(model=MODEL, prompt="x", stop=["y" * 1_000_000])
    assert info.value.body["param"] == "stop" and "at most" in info.value.body["message"]


@pytest.fixture(scope="module")
def long_context_model(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    out = tmp_path_factory.mktemp("long-context")
    for path in model_dir.iterdir():
        shutil.copy(path, out)
    (out / "config.json").write_text(json.dumps({"eos_token_id": 0, "max_position_embeddings": LONG_CONTEXT}))
    return out


async def test_a_request_too_large_for_a_nats_message_gets_400(
    nats_server: NatsServer, long_context_model: Path  # noqa: F811
) -> None:
    server, nc = await start_gateway(nats_server, long_context_model, max_model_len=LONG_CONTEXT)
    detokenizer = await connect(nats_server.settings(NatsRole.ADMIN), "test-detokenizer")
    opened: asyncio.Queue[DetokOpen] = asyncio.Queue()

    async def answer(msg) -> None:
        await opened.put(DetokOpen.from_bytes(msg.data))
        await msg.respond(DetokReady(detok_id="test").to_bytes())

    await detokenizer.subscribe(subjects.DETOK_OPEN, cb=answer)
    cancels = await detokenizer.subscribe(subjects.CANCEL)
    try:
        # Not through the openai client, which spends seconds walking a prompt this long before sending it.
        body = {"model": MODEL, "prompt": [i % VOCAB_SIZE for i in range(OVERSIZED_PROMPT_TOKENS)], "max_tokens": 1}
        async with aiohttp.ClientSession() as session:
            async with session.post(server.make_url("/v1/completions"), json=body) as response:
                status, error = response.status, (await response.json())["error"]
        assert status == 400 and error["code"] == "request_too_large" and "max_payload" in error["message"]
        # The detokenizer that took the request is told to let it go.
        opening = await asyncio.wait_for(opened.get(), WAIT_S)
        cancel = Cancel.from_bytes((await cancels.next_msg(timeout=WAIT_S)).data)
        assert cancel.request_id == opening.request_id
    finally:
        await detokenizer.drain()
        await server.close()
        await nc.drain()
