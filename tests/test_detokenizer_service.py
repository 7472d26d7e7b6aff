"""The detokenizer service against a real nats-server and a real tokenizer: frames in, chunks out."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sysconfig
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import nats.errors
import numpy as np
import pytest
from nats.aio.client import Client
from prometheus_client import REGISTRY

from services.detokenizer import service
from services.worker.demo_model.tokenizer import train_tokenizer
from shared import subjects
from shared.frames import FinishReason, FrameBuilder, FrameKind, SeqStatus
from shared.nats_roles import NatsRole
from shared.natsutil import barrier
from shared.schemas import Cancel, Chunk, DetokOpen, DetokReady
from shared.tokenizer import Tokenizer
from tests.natsfixture import NatsServer, nats_server, wait_for_everything  # noqa: F401  (the fixture is used by name)

VOCAB_SIZE = 600
TRAINING_FILES = ("argparse.py", "codecs.py", "json/encoder.py")
WORKER_ID = 4
DETOK_ID = "detok-under-test"
DETOK_FRAMES = subjects.frames(DETOK_ID)
TOP_K = 2
PROMPT_TOKENS = 5
RECEIVE_TIMEOUT_S = 5.0
PROBE_TIMEOUT_S = 0.2
SILENCE_S = 0.3  # how long to listen before concluding that nothing more arrives


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("model")
    stdlib = Path(sysconfig.get_path("stdlib"))
    train_tokenizer([(stdlib / name).read_text() for name in TRAINING_FILES], VOCAB_SIZE, out)
    return out


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer(model_dir)


class Worker:
    """Publishes frames the way a worker does: per step a DRAFT frame (if any) then the TARGET frame."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.step = 0

    @staticmethod
    def add(
        builder: FrameBuilder, request_id: str, ids: list[int], finish: FinishReason = FinishReason.NONE, **fields
    ) -> None:
        n = len(ids)
        token_ids = np.array([[t] + [(t + j) % VOCAB_SIZE for j in range(1, builder.top_k + 1)] for t in ids])
        logprobs = np.array([[-0.5 * j for j in range(builder.top_k + 1)]] * n)
        builder.add(
            request_id,
            token_ids=token_ids.reshape(n, builder.top_k + 1),
            logprobs=logprobs.reshape(n, builder.top_k + 1),
            ranks=np.ones(n),
            status=SeqStatus.RUNNING if finish == FinishReason.NONE else SeqStatus.FINISHED,
            finish_reason=finish,
            **fields,
        )

    def builders(self) -> tuple[FrameBuilder, FrameBuilder]:
        self.step += 1
        return (
            FrameBuilder(FrameKind.DRAFT, WORKER_ID, self.step, TOP_K),
            FrameBuilder(FrameKind.TARGET, WORKER_ID, self.step, TOP_K),
        )

    async def publish(self, draft: FrameBuilder, target: FrameBuilder) -> None:
        if len(draft):
            await self.nc.publish(DETOK_FRAMES, draft.encode())
        await self.nc.publish(DETOK_FRAMES, target.encode())


async def open_request(nc: Client, **fields) -> tuple[str, asyncio.Queue]:
    """Subscribes to a fresh reply subject, then opens a request there, as the gateway does."""
    request_id = uuid.uuid4().hex
    reply_subject = subjects.responses(request_id)  # a gateway's subject: the only kind a detokenizer may answer on
    await wait_for_everything(nc, request_id)
    chunks: asyncio.Queue[Chunk] = asyncio.Queue()

    async def received(msg) -> None:
        await chunks.put(Chunk.from_bytes(msg.data))

    await nc.subscribe(reply_subject, cb=received)
    fields = {"api": "chat", "num_prompt_tokens": PROMPT_TOKENS} | fields
    opened = DetokOpen(request_id=request_id, reply_subject=reply_subject, **fields)
    reply = await nc.request(subjects.DETOK_OPEN, opened.to_bytes(), timeout=RECEIVE_TIMEOUT_S)
    assert DetokReady.from_bytes(reply.data).detok_id == DETOK_ID
    return request_id, chunks


async def finish_immediately(nc: Client, worker: Worker, request_id: str, eos: int) -> None:
    draft, target = worker.builders()
    Worker.add(target, request_id, [eos], seq_no=0, offset=0, finish=FinishReason.STOP)
    await worker.publish(draft, target)


async def next_chunk(chunks: asyncio.Queue) -> Chunk:
    return await asyncio.wait_for(chunks.get(), RECEIVE_TIMEOUT_S)


async def until_final(chunks: asyncio.Queue) -> list[Chunk]:
    out = [await next_chunk(chunks)]
    while not out[-1].final:
        out.append(await next_chunk(chunks))
    return out


def counter(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture(scope="module")
async def nc(nats_server: NatsServer, model_dir: Path, tokenizer: Tokenizer) -> AsyncIterator[Client]:  # noqa: F811
    parser = argparse.ArgumentParser()
    service.add_arguments(parser)
    args = parser.parse_args([
        "--nats-url", nats_server.url, "--nats-credentials", str(nats_server.credentials_file(NatsRole.DETOKENIZER)),
        "--model", str(model_dir), "--metrics-port", "0", "--detokenizer-id", DETOK_ID,
    ])
    task = asyncio.create_task(service.run(args))
    # The test plays the gateway and the worker: the admin user may do both.
    client = await nats.connect(nats_server.url, **nats_server.settings(NatsRole.ADMIN).connect_options())
    worker = Worker(client)
    eos = min(tokenizer.eos_token_ids)
    # The service is ready once a request opened and finished through it comes back.
    for _ in range(int(RECEIVE_TIMEOUT_S / PROBE_TIMEOUT_S)):
        try:
            request_id, chunks = await open_request(client)
        except nats.errors.NoRespondersError:
            await asyncio.sleep(PROBE_TIMEOUT_S)
            continue
        await barrier(client)
        await finish_immediately(client, worker, request_id, eos)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(chunks.get(), PROBE_TIMEOUT_S)
            break
    else:
        raise TimeoutError("the detokenizer service never answered")
    yield client
    await client.drain()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


@pytest.fixture
def worker(nc: Client) -> Worker:
    return Worker(nc)


async def test_chat_stream_with_drafts_and_a_stop_string(nc: Client, worker: Worker, tokenizer: Tokenizer) -> None:
    cancels: asyncio.Queue[Cancel] = asyncio.Queue()

    async def cancelled(msg) -> None:
        await cancels.put(Cancel.from_bytes(msg.data))

    await nc.subscribe(subjects.STOP, cb=cancelled)
    request_id, chunks = await open_request(nc, stop=["\n\n", " x"], logprobs=1, include_draft_logprobs=True)
    await barrier(nc)
    first = tokenizer.encode("hello", add_special_tokens=False)
    second = tokenizer.encode(" wor x\n\n and more", add_special_tokens=False)

    draft, target = worker.builders()
    Worker.add(draft, request_id, first + [first[0]], seq_no=0, offset=0, num_accepted=len(first))
    Worker.add(target, request_id, first, seq_no=0, offset=0, num_accepted=len(first) - 1)
    await worker.publish(draft, target)
    draft, target = worker.builders()
    Worker.add(target, request_id, second, seq_no=1, offset=len(first))
    await worker.publish(draft, target)

    received = await until_final(chunks)
    assert [c.seq for c in received] == list(range(len(received)))
    assert "".join(c.choice["delta"].get("content", "") for c in received) == "hello wor"
    assert received[-1].choice["finish_reason"] == "stop"
    assert received[-1].usage.prompt_tokens == PROMPT_TOKENS
    drafted = received[0].choice["draft_logprobs"]["content"]
    assert [e["accepted"] for e in drafted] == [True] * len(first) + [False]
    assert all(len(e["top_logprobs"]) == 1 for e in received[0].choice["logprobs"]["content"])
    cancel = await asyncio.wait_for(cancels.get(), RECEIVE_TIMEOUT_S)
    assert cancel == Cancel(request_id=request_id, reason="stop_string")


async def test_malformed_frames_are_counted_and_do_not_stop_the_service(
    nc: Client, worker: Worker, tokenizer: Tokenizer
) -> None:
    bad_magic_before = counter("specmesh_detokenizer_malformed_frames_total", reason="bad_magic")
    truncated_before = counter("specmesh_detokenizer_malformed_frames_total", reason="truncated")
    await nc.publish(DETOK_FRAMES, b"\xff" * 64)
    await nc.publish(DETOK_FRAMES, b"\x00" * 3)

    request_id, chunks = await open_request(nc, api="completion")
    await barrier(nc)
    ids = tokenizer.encode("print(1)", add_special_tokens=False)
    draft, target = worker.builders()
    Worker.add(target, request_id, ids, seq_no=0, offset=0, finish=FinishReason.LENGTH)
    await worker.publish(draft, target)

    (chunk,) = await until_final(chunks)
    assert chunk.choice["text"] == "print(1)" and chunk.choice["finish_reason"] == "length"
    assert chunk.choice["logprobs"] is None and chunk.usage.completion_tokens == len(ids)
    assert counter("specmesh_detokenizer_malformed_frames_total", reason="bad_magic") == bad_magic_before + 1
    assert counter("specmesh_detokenizer_malformed_frames_total", reason="truncated") == truncated_before + 1


async def test_frames_of_unknown_requests_are_counted_and_dropped(nc: Client, worker: Worker) -> None:
    before = counter("specmesh_detokenizer_unknown_request_frames_total")
    draft, target = worker.builders()
    Worker.add(target, uuid.uuid4().hex, [5, 6], seq_no=0, offset=0)
    await worker.publish(draft, target)

    request_id, chunks = await open_request(nc)
    await barrier(nc)
    draft, target = worker.builders()
    Worker.add(target, request_id, [], seq_no=0, offset=0, finish=FinishReason.ABORT)
    await worker.publish(draft, target)
    (chunk,) = await until_final(chunks)
    assert chunk.error is not None
    assert counter("specmesh_detokenizer_unknown_request_frames_total") == before + 1


async def test_cancelled_request_gets_no_more_chunks(nc: Client, worker: Worker, tokenizer: Tokenizer) -> None:
    request_id, chunks = await open_request(nc)
    await barrier(nc)
    ids = tokenizer.encode("abc def", add_special_tokens=False)
    draft, target = worker.builders()
    Worker.add(target, request_id, ids[:1], seq_no=0, offset=0)
    await worker.publish(draft, target)
    assert (await next_chunk(chunks)).seq == 0

    unknown_before = counter("specmesh_detokenizer_unknown_request_frames_total")
    await nc.publish(subjects.CANCEL, Cancel(request_id=request_id, reason="client_disconnected").to_bytes())
    await barrier(nc)
    await asyncio.sleep(SILENCE_S)
    draft, target = worker.builders()
    Worker.add(target, request_id, ids[1:], seq_no=1, offset=1)
    await worker.publish(draft, target)
    await asyncio.sleep(SILENCE_S)
    assert chunks.empty()
    assert counter("specmesh_detokenizer_unknown_request_frames_total") == unknown_before  # late, not unknown


async def test_two_requests_in_one_frame_with_a_gap(nc: Client, worker: Worker, tokenizer: Tokenizer) -> None:
    healthy, healthy_chunks = await open_request(nc, api="completion", logprobs=0)
    broken, broken_chunks = await open_request(nc)
    await barrier(nc)
    ids = tokenizer.encode("x = 1", add_special_tokens=False)
    draft, target = worker.builders()
    Worker.add(target, broken, ids, seq_no=1, offset=3)
    Worker.add(target, healthy, ids, seq_no=0, offset=0, finish=FinishReason.LENGTH)
    await worker.publish(draft, target)

    (failed,) = await until_final(broken_chunks)
    assert failed.final and "lost frames" in failed.error
    (done,) = await until_final(healthy_chunks)
    assert done.choice["text"] == "x = 1" and done.choice["logprobs"]["text_offset"][0] == 0
