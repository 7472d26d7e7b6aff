"""The worker's queue loop on a real engine process (the tiny checkpoint) and a real nats-server: the engine steps
on while the event loop cannot publish, yet every request's frames arrive in step order, DRAFT before TARGET, and its
message is acknowledged only after its finishing frame; stop() publishes every step taken and hands back the rest."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from services.worker.engine_process import EngineProcess
from services.worker.engine_protocol import MAX_UNSENT_STEPS
from services.worker.metrics import WorkerMetrics
from services.worker.queue_worker import QueueWorker
from services.worker.takeover import came_back, delivery_id
from shared import subjects
from shared.config import EngineConfig, SpeculativeConfig
from shared.frames import Frame, FrameKind, SeqStatus, decode
from shared.nats_roles import NatsRole
from shared import streams
from shared.natsutil import barrier
from shared.schemas import (
    Cancel, ChoiceProgress, ProgressQuery, ProgressReport, SamplingParams, TakeOver, WorkRequest,
)
from shared.tokenizer import Tokenizer
from tests.modelfixture import tiny_model_dir  # noqa: F401  (fixtures are used by name)
from tests.natsfixture import NatsServer, nats_server  # noqa: F401

WORKER_ID = 7
DETOK_ID = "queue-worker-test"
MAX_MODEL_LEN = 512
MAX_TOKENS = 300  # long enough to still be running after every blocked stretch of the event loop
REPETITIVE = "import os\nimport sys\nimport os\nimport sys\nimport os\n"  # prompt lookup drafts on it
BLOCKS = 3
BLOCK_S = 0.5  # far longer than a step of the tiny model
RECEIVE_TIMEOUT_S = 60.0
STALL_S = 0.3  # an engine stall timeout the tests wait out


@dataclass
class Received:
    """The frames a detokenizer would get, in arrival order."""

    frames: list[Frame] = field(default_factory=list)
    finished: asyncio.Event = field(default_factory=asyncio.Event)

    async def on_frame(self, msg) -> None:
        frame = decode(msg.data)
        self.frames.append(frame)
        if frame.kind == FrameKind.TARGET and any(r["status"] == SeqStatus.FINISHED for r in frame.records):
            self.finished.set()

    def targets(self) -> list[Frame]:
        return [f for f in self.frames if f.kind == FrameKind.TARGET]


@dataclass
class Running:
    worker: QueueWorker
    engine: EngineProcess
    received: Received
    nc: Client
    stepping: asyncio.Task
    fetching: asyncio.Task


@pytest.fixture
async def running(nats_server: NatsServer, tiny_model_dir: Path) -> AsyncIterator[Running]:  # noqa: F811
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    config = EngineConfig(model=tiny_model_dir, max_num_seqs=2, max_model_len=MAX_MODEL_LEN, speculative=spec)
    engine = await EngineProcess.start(config, WORKER_ID, torch_threads=1)
    # The worker connects as the worker's NATS user; the test, playing gateway and detokenizer, as the admin.
    worker_nc = await nats.connect(nats_server.url, **nats_server.settings(NatsRole.WORKER).connect_options())
    nc = await nats.connect(nats_server.url, **nats_server.settings(NatsRole.ADMIN).connect_options())
    js = worker_nc.jetstream()
    await streams.wait_for(js, streams.WORKER_NEEDS, "worker")
    await nc.jetstream().purge_stream(subjects.REQUEST_STREAM)
    received = Received()
    await nc.subscribe(subjects.frames(DETOK_ID), cb=received.on_frame)
    await barrier(nc)
    worker = QueueWorker(engine, worker_nc, WORKER_ID, WorkerMetrics(tiny_model_dir.name, spec.method, WORKER_ID))
    psub = await js.pull_subscribe_bind(subjects.WORKER_CONSUMER, subjects.REQUEST_STREAM)
    fetching = asyncio.create_task(worker.fetch_loop(psub))
    stepping = asyncio.create_task(worker.publish_loop())
    yield Running(worker, engine, received, nc, stepping, fetching)
    fetching.cancel()
    worker.stop()
    await asyncio.gather(fetching, stepping, return_exceptions=True)
    await psub.unsubscribe()
    await worker_nc.close()
    await nc.close()
    await engine.close()


async def submit(nc: Client, model_dir: Path) -> WorkRequest:
    request = WorkRequest(
        request_id=uuid.uuid4().hex,
        prompt_token_ids=tuple(Tokenizer(model_dir).encode(REPETITIVE)),
        detok_id=DETOK_ID,
        sampling=SamplingParams(
            temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1, include_draft_logprobs=True
        ),
        created=time.time(),
    )
    await nc.jetstream().publish(subjects.REQUESTS, request.to_bytes())
    return request


async def num_ack_pending(nc: Client) -> int:
    info = await nc.jetstream().consumer_info(subjects.REQUEST_STREAM, subjects.WORKER_CONSUMER)
    return info.num_ack_pending


async def until_acknowledged(nc: Client) -> None:
    """JetStream applies an ack on its own schedule, so the count may lag the ack by a moment."""
    deadline = time.monotonic() + RECEIVE_TIMEOUT_S
    while await num_ack_pending(nc):
        assert time.monotonic() < deadline, "the finished request was never acknowledged"
        await asyncio.sleep(0.01)


async def until(condition, what: str) -> None:
    deadline = time.monotonic() + RECEIVE_TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


@pytest.mark.exclusive  # bounds a time: alone, not beside another worker's tests (tests/conftest.py)
async def test_engine_steps_on_while_the_event_loop_cannot_publish(running: Running, tiny_model_dir: Path) -> None:  # noqa: F811
    request = await submit(running.nc, tiny_model_dir)
    await until(lambda: running.received.targets(), "the first frame")
    assert await num_ack_pending(running.nc) == 1  # held, unacknowledged, while it runs
    blocks = []
    for _ in range(BLOCKS):
        await asyncio.sleep(0.05)  # lets the loop send what is ready
        started = time.time()
        time.sleep(BLOCK_S)  # blocks the event loop: nothing is published meanwhile
        blocks.append((started, time.time()))

    await asyncio.wait_for(running.received.finished.wait(), RECEIVE_TIMEOUT_S)
    # The steps the engine ended while the loop was blocked, from their frames' headers (the engine's clock).
    step_ends = {f.step: f.sent_at_us / 1e6 for f in running.received.targets()}
    advances = [sum(start < end <= stop for end in step_ends.values()) for start, stop in blocks]
    # A step the loop has not sent yet may be in progress when a block starts (then the engine cannot start another
    # one), so at least one of the blocks, not each, shows the next step ended while nothing could be published.
    assert any(a > 0 for a in advances), f"the engine waited for the event loop: {advances}"
    assert all(a <= MAX_UNSENT_STEPS for a in advances), f"the engine ran unboundedly ahead: {advances}"
    await until_acknowledged(running.nc)
    ids = request.request_id
    kinds_steps = [(f.kind, f.step) for f in running.received.frames]
    targets = running.received.targets()
    steps = [f.step for f in targets]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)
    records = [r for f in targets for r in f.records if r["request_id"].tobytes().hex() == ids]
    assert [int(r["seq_no"]) for r in records] == list(range(len(records)))
    offsets = [int(r["offset"]) for r in records]
    assert offsets == sorted(offsets) and offsets[-1] + int(records[-1]["num_tokens"]) == MAX_TOKENS
    drafts = [(kind, step) for kind, step in kinds_steps if kind == FrameKind.DRAFT]
    assert drafts, "the repetitive prompt must get ngram drafts"
    for kind, step in drafts:
        assert kinds_steps.index((kind, step)) < kinds_steps.index((FrameKind.TARGET, step))


async def test_stop_publishes_every_step_taken(running: Running, tiny_model_dir: Path) -> None:  # noqa: F811
    request = await submit(running.nc, tiny_model_dir)
    await until(lambda: len(running.received.targets()) >= 3, "three steps")
    running.worker.stop()
    await asyncio.wait_for(running.stepping, RECEIVE_TIMEOUT_S)
    await barrier(running.nc)
    await asyncio.sleep(0.1)  # the subscriber's callbacks run
    (choice,) = running.engine.stopped.unfinished[request.request_id].progress
    records = [r for f in running.received.targets() for r in f.records]
    assert sum(int(r["num_tokens"]) for r in records) == len(choice.output_token_ids) < MAX_TOKENS
    assert choice.next_seq_no == len(records)
    assert running.worker.num_in_flight == 1 and await running.worker.hand_back() == 1


async def came_back_to(
    running: Running, model_dir: Path, detok_id: str, sampling: SamplingParams = SamplingParams(temperature=0.0,
                                                                                                max_tokens=8)
) -> Msg:
    """A request another worker had: its message back on the shared queue, marked as delivered before (as a routed
    one is moved); returns the query this worker sends its detokenizer, unanswered."""
    queries: asyncio.Queue = asyncio.Queue()
    await running.nc.subscribe(subjects.progress(detok_id), cb=queries.put)
    await barrier(running.nc)
    request = WorkRequest(request_id=uuid.uuid4().hex, prompt_token_ids=tuple(Tokenizer(model_dir).encode(REPETITIVE)),
                          detok_id=detok_id, sampling=sampling, created=time.time())
    await running.nc.jetstream().publish(subjects.RESUMED_REQUESTS, request.to_bytes(),
                                         headers={subjects.DELIVERED_BEFORE_HEADER: "1"})
    return await asyncio.wait_for(queries.get(), RECEIVE_TIMEOUT_S)


async def test_a_take_over_cut_short_by_a_drain_goes_back_as_a_request_that_came_back(
    running: Running, tiny_model_dir: Path  # noqa: F811
) -> None:
    """A drain hands back a request whose detokenizer has not answered yet: it never reached the engine and carries
    no progress, so it must go back marked, under the delivery it continues, or the next worker would start it anew
    without asking, its frames dropped at the detokenizer (not the owner's) and its client left waiting."""
    asked = ProgressQuery.from_bytes((await came_back_to(running, tiny_model_dir, "slow-detokenizer")).data)
    running.fetching.cancel()
    running.worker.stop()
    await asyncio.wait_for(running.stepping, RECEIVE_TIMEOUT_S)
    assert await running.worker.hand_back() == 1
    psub = await running.nc.jetstream().pull_subscribe_bind(subjects.WORKER_CONSUMER, subjects.REQUEST_STREAM)
    (again,) = await psub.fetch(batch=1, timeout=RECEIVE_TIMEOUT_S)
    await again.ack()
    await psub.unsubscribe()
    assert came_back(again, WorkRequest.from_bytes(again.data)) and delivery_id(again) == asked.delivery


async def test_an_idle_engine_is_no_hung_one_while_a_request_that_came_back_is_asked_about(
    running: Running, tiny_model_dir: Path  # noqa: F811
) -> None:
    """An engine idle past the stall timeout, and a request that came back (every request a decode worker takes):
    while its detokenizer is asked, the engine holds nothing, and no stall may be reported (that stops the
    heartbeats, and every request of the worker runs again elsewhere)."""
    running.worker._stall_after_s = STALL_S
    await asyncio.sleep(2 * STALL_S)
    msg = await came_back_to(running, tiny_model_dir, "asked-detokenizer")
    stalled = running.worker.stalled
    await msg.respond(ProgressReport(outcome=TakeOver.CLOSED).to_bytes())
    await until_acknowledged(running.nc)
    assert not stalled


async def test_a_worker_told_it_lost_a_request_drops_it_and_leaves_its_message_unsettled(
    running: Running, tiny_model_dir: Path  # noqa: F811
) -> None:
    """The detokenizer's release (a stalled worker's records came after another worker took the request over): the
    engine drops the request, and its message is not acknowledged, which would take it from the work queue under
    the new owner. A release for another worker changes nothing here."""
    prompt = tuple(Tokenizer(tiny_model_dir).encode(REPETITIVE))
    request = WorkRequest(  # sampled, so that drafts are seldom kept: hundreds of steps, far longer than the test
        request_id=uuid.uuid4().hex, prompt_token_ids=prompt, detok_id=DETOK_ID, created=time.time(),
        sampling=SamplingParams(temperature=1.0, seed=1, max_tokens=MAX_MODEL_LEN - len(prompt), ignore_eos=True),
    )
    await running.nc.jetstream().publish(subjects.REQUESTS, request.to_bytes())
    await until(lambda: running.received.targets(), "the first frame")
    for worker_id in (WORKER_ID + 1, WORKER_ID):
        release = Cancel(request_id=request.request_id, reason="taken_over", worker_id=worker_id)
        await running.worker.on_cancel(Msg(running.nc, subject=subjects.STOP, data=release.to_bytes()))
        assert running.worker.num_in_flight == (worker_id != WORKER_ID)
    # Until the engine reports the abort, the request would not run here again (the engine aborts by request id);
    # the report settles nothing.
    assert request.request_id in running.worker._released
    # A delivery of it back here meanwhile (the new owner died) is parked, heartbeated, and taken once the engine
    # has reported the abort: taken at once, it would be aborted with the old run.
    back = Msg(running.nc, subject=subjects.RESUMED_REQUESTS, data=request.to_bytes(),
               reply=f"$JS.ACK.{subjects.REQUEST_STREAM}.{subjects.WORKER_CONSUMER}.2.99.99.0.0")
    await running.worker._take(back)
    assert running.worker._parked == {request.request_id: back}
    await until(lambda: request.request_id not in running.worker._released, "the abort's report")
    assert not running.worker._parked
    sent = len(running.received.frames)
    await asyncio.sleep(0.5)  # hundreds of steps of the tiny model
    assert len(running.received.frames) == sent, "the engine dropped the request"
    assert not running.received.finished.is_set() and await num_ack_pending(running.nc) == 1


async def test_a_release_that_crossed_a_take_over_here_is_ignored(
    running: Running, tiny_model_dir: Path  # noqa: F811
) -> None:
    """A release sent before this worker took the request over (about the run before), arriving after the answer:
    the run just taken over goes on. A worker loses a request only after ack_wait, so a real release comes later."""
    long = SamplingParams(temperature=1.0, seed=1, max_tokens=400, ignore_eos=True)  # hundreds of steps
    asked = await came_back_to(running, tiny_model_dir, "crossing-detokenizer", long)
    query = ProgressQuery.from_bytes(asked.data)
    await asked.respond(ProgressReport(outcome=TakeOver.CONTINUE, progress=(ChoiceProgress(index=0),),
                                       migrations=1).to_bytes())
    await until(lambda: query.request_id not in running.worker._asking, "the take-over's answer")
    release = Cancel(request_id=query.request_id, reason="taken_over", worker_id=WORKER_ID)
    await running.worker.on_cancel(Msg(running.nc, subject=subjects.STOP, data=release.to_bytes()))
    assert running.worker.num_in_flight == 1 and query.request_id not in running.worker._released
    await until_acknowledged(running.nc)  # it ran to its end here
