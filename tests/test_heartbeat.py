"""A live worker never loses its requests to the short ack_wait: its heartbeats (in_progress on the work queue) go
out every REQUEST_HEARTBEAT_S from the event loop while the engine process computes a long step. Measured on what
NATS itself receives: the +WPI messages on the consumer's ack subjects."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections import defaultdict

import nats
import pytest

from services.worker.engine_process import EngineProcess
from services.worker.metrics import WorkerMetrics
from services.worker.queue_worker import QueueWorker
from shared import subjects
from shared.config import DEFAULT_MODEL_DIR, EngineConfig, SpeculativeConfig
from shared.frames import FrameKind, decode
from shared.nats_roles import NatsRole
from shared import streams
from shared.natsutil import REQUEST_ACK_WAIT_S, REQUEST_HEARTBEAT_S, barrier
from shared.schemas import SamplingParams, WorkRequest
from tests.natsfixture import NatsServer, nats_server  # noqa: F401  (fixtures are used by name)

WORKER_ID = 11
DETOK_ID = "heartbeat-test"
NUM_REQUESTS = 8
# Eight prompts this long, prefilled in one packed pass (chunked prefill off), make a step of two seconds or more.
PROMPT_LEN = 1900
MAX_MODEL_LEN = 2048
IN_PROGRESS = b"+WPI"
# A heartbeat may come this much later than its period and still leave ack_wait far away.
MAX_GAP_S = REQUEST_HEARTBEAT_S + 0.5
DONE_TIMEOUT_S = 120.0


@pytest.mark.exclusive  # bounds a time: alone, not beside another worker's tests (tests/conftest.py)
async def test_heartbeats_keep_their_pace_through_a_long_prefill(nats_server: NatsServer) -> None:  # noqa: F811
    spec = SpeculativeConfig(method="naive", num_speculative_tokens=0)
    config = EngineConfig(
        model=DEFAULT_MODEL_DIR, max_num_seqs=NUM_REQUESTS, max_model_len=MAX_MODEL_LEN, speculative=spec,
        enable_chunked_prefill=False,
    )
    engine = await EngineProcess.start(config, WORKER_ID, torch_threads=1)
    worker_nc = await nats.connect(nats_server.url, **nats_server.settings(NatsRole.WORKER).connect_options())
    admin = await nats.connect(nats_server.url, **nats_server.settings(NatsRole.ADMIN).connect_options())
    await streams.wait_for(worker_nc.jetstream(), streams.WORKER_NEEDS, "worker")
    await admin.jetstream().purge_stream(subjects.REQUEST_STREAM)
    beats: dict[str, list[float]] = defaultdict(list)  # per message (its ack subject), when each heartbeat arrived
    step_ends: list[float] = []  # when each step that sent frames ended, from the frames' headers (seconds)

    async def on_ack(msg) -> None:
        if msg.data == IN_PROGRESS:
            beats[msg.subject].append(time.monotonic())

    async def on_frame(msg) -> None:
        frame = decode(msg.data)
        if frame.kind == FrameKind.TARGET:
            step_ends.append(frame.sent_at_us / 1e6)

    await admin.subscribe(f"$JS.ACK.{subjects.REQUEST_STREAM}.{subjects.WORKER_CONSUMER}.>", cb=on_ack)
    await admin.subscribe(subjects.frames(DETOK_ID), cb=on_frame)
    await barrier(admin)
    worker = QueueWorker(engine, worker_nc, WORKER_ID, WorkerMetrics(DEFAULT_MODEL_DIR.name, spec.method, WORKER_ID))
    psub = await worker_nc.jetstream().pull_subscribe_bind(subjects.WORKER_CONSUMER, subjects.REQUEST_STREAM)
    rng = random.Random(0)
    for _ in range(NUM_REQUESTS):
        prompt = tuple(rng.randrange(engine.ready.vocab_size) for _ in range(PROMPT_LEN))
        sampling = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        request = WorkRequest(
            request_id=uuid.uuid4().hex, prompt_token_ids=prompt, detok_id=DETOK_ID, sampling=sampling,
            created=time.time(),
        )
        await admin.jetstream().publish(subjects.REQUESTS, request.to_bytes())
    published = time.time()
    tasks = [asyncio.create_task(c) for c in (worker.fetch_loop(psub), worker.heartbeat_loop(), worker.publish_loop())]
    try:
        deadline = time.monotonic() + DONE_TIMEOUT_S
        while not step_ends or worker.num_in_flight:
            assert time.monotonic() < deadline, "the requests did not finish"
            await asyncio.sleep(0.05)
    finally:
        for task in tasks[:2]:
            task.cancel()
        worker.stop()
        await asyncio.gather(*tasks, return_exceptions=True)
        await psub.unsubscribe()
        await worker_nc.close()
        await admin.close()
        await engine.close()
    ends = [published] + sorted(step_ends)
    longest_step = max(later - earlier for earlier, later in zip(ends, ends[1:]))
    gaps = [later - earlier for times in beats.values() for earlier, later in zip(times, times[1:])]
    print(f"\nlongest step {longest_step:.2f} s; {len(gaps) + len(beats)} heartbeats, longest gap {max(gaps):.3f} s "
          f"(period {REQUEST_HEARTBEAT_S} s, ack_wait {REQUEST_ACK_WAIT_S} s)")
    assert longest_step > 2 * REQUEST_HEARTBEAT_S, "no step was long enough to show anything"
    assert len(beats) == NUM_REQUESTS and max(gaps) <= MAX_GAP_S
