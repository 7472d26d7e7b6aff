"""The worker process: takes requests from the JetStream work queue, steps the engine, publishes frames.

The engine runs in one dedicated thread so that NATS traffic keeps flowing while the model computes. A
request's message is acknowledged only when the request is finished; until then the worker tells JetStream
it is still in progress, so a request held by a crashed worker is redelivered rather than lost.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from pydantic import ValidationError

from shared import subjects
from shared.config import DEFAULT_MODEL_DIR, EngineConfig, SpeculativeConfig
from shared.frames import FinishReason, FrameBuilder, FrameKind, SeqStatus
from shared.natsutil import REQUEST_ACK_WAIT_S, connect, ensure_request_stream
from shared.schemas import Cancel, WorkRequest
from services.worker.engine import Engine
from services.worker.publisher import step_frames

log = logging.getLogger("specmesh.worker")

FETCH_TIMEOUT_S = 0.5  # how long an idle worker waits on the queue before checking for shutdown
HEARTBEAT_S = REQUEST_ACK_WAIT_S / 3
RECENT_CANCELS = 4096  # cancellations remembered for requests that have not arrived yet


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--speculative-config", default=None, help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\'')
    parser.add_argument("--max-num-seqs", type=int, default=EngineConfig.model_fields["max_num_seqs"].default)
    parser.add_argument("--max-model-len", type=int, default=EngineConfig.model_fields["max_model_len"].default)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--worker-id", type=int, default=None, help="numeric id in frame headers (default: the pid)")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        device=args.device,
        dtype=args.dtype,
        speculative=SpeculativeConfig.from_json(args.speculative_config),
    )


class Worker:
    def __init__(self, engine: Engine, nc, worker_id: int) -> None:
        self.engine = engine
        self.nc = nc
        self.worker_id = worker_id
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._inbox: list[tuple[WorkRequest, Msg]] = []
        self._cancels: list[str] = []
        self._recent_cancels: OrderedDict[str, None] = OrderedDict()
        self._messages: dict[str, Msg] = {}  # unacknowledged work-queue messages by request id
        self._wake = asyncio.Event()

    @property
    def capacity(self) -> int:
        """Requests worth fetching now: free slots plus one batch of waiting ones to keep steps full."""
        return 2 * self.engine.config.max_num_seqs - len(self._messages) - len(self._inbox)

    async def on_cancel(self, msg: Msg) -> None:
        try:
            cancel = Cancel.from_bytes(msg.data)
        except (ValidationError, ValueError) as exc:
            log.warning("ignoring malformed cancel: %s", exc)
            return
        self._recent_cancels[cancel.request_id] = None
        while len(self._recent_cancels) > RECENT_CANCELS:
            self._recent_cancels.popitem(last=False)
        self._cancels.append(cancel.request_id)
        self._wake.set()

    async def fetch_loop(self, psub) -> None:
        while True:
            if self.capacity <= 0:
                await asyncio.sleep(0.01)
                continue
            try:
                msgs = await psub.fetch(batch=self.capacity, timeout=FETCH_TIMEOUT_S)
            except (NatsTimeoutError, asyncio.TimeoutError):
                continue
            for msg in msgs:
                try:
                    request = WorkRequest.from_bytes(msg.data)
                except (ValidationError, ValueError) as exc:
                    log.error("dropping malformed work request: %s", exc)
                    await msg.term()
                    continue
                if request.request_id in self._recent_cancels:
                    await msg.ack()
                    continue
                if request.request_id in self._messages:
                    log.warning("request %s is already running here; ignoring the redelivery", request.request_id)
                    continue
                self._inbox.append((request, msg))
            self._wake.set()

    async def heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            for msg in list(self._messages.values()):
                await msg.in_progress()

    def _step(self, inbox: list[tuple[WorkRequest, Msg]], cancels: list[str]) -> tuple[list[bytes], list[str]]:
        """Runs in the engine thread: admits, cancels and steps; returns frames and finished request ids."""
        refused = []
        for request, _ in inbox:
            try:
                self.engine.add_request(request)
            except ValueError as exc:
                log.warning("refusing request %s: %s", request.request_id, exc)
                refused.append(request.request_id)
        finished = list(refused)
        for request_id in cancels:
            if self.engine.abort(request_id) is not None:
                finished.append(request_id)
        frames = []
        if refused:
            frames.append(_abort_frame(refused, self.worker_id, self.engine.step_no))
        if self.engine.has_work():
            outputs = self.engine.step()
            frames += step_frames(outputs, self.worker_id, self.engine.step_no)
            finished += [o.seq.request_id for o in outputs if o.seq.is_finished]
        return frames, finished

    async def engine_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not (self._inbox or self._cancels or self.engine.has_work()):
                self._wake.clear()
                await self._wake.wait()
            inbox, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, []
            for request, msg in inbox:
                self._messages[request.request_id] = msg
            frames, finished = await loop.run_in_executor(self._pool, self._step, inbox, cancels)
            for frame in frames:
                await self.nc.publish(subjects.FRAMES, frame)
            for request_id in finished:
                msg = self._messages.pop(request_id, None)
                if msg is not None:
                    await msg.ack()


def _abort_frame(request_ids: list[str], worker_id: int, step: int) -> bytes:
    builder = FrameBuilder(FrameKind.TARGET, worker_id, step, top_k=0)
    empty = np.empty((0, 1))
    for request_id in request_ids:
        builder.add(
            request_id, seq_no=0, offset=0, token_ids=empty, logprobs=empty, ranks=np.empty(0),
            status=SeqStatus.FINISHED, finish_reason=FinishReason.ABORT,
        )
    return builder.encode()


async def run(args: argparse.Namespace) -> None:
    config = engine_config(args)
    started = time.time()
    engine = Engine(config)
    log.info(
        "model %s loaded in %.1fs; speculation %s", config.model, time.time() - started,
        config.speculative.model_dump_json(),
    )
    nc = await connect(args.nats_url, "worker")
    js = nc.jetstream()
    await ensure_request_stream(js)
    worker = Worker(engine, nc, args.worker_id if args.worker_id is not None else os.getpid())
    await nc.subscribe(subjects.CANCEL, cb=worker.on_cancel)
    psub = await js.pull_subscribe_bind(subjects.WORKER_CONSUMER, subjects.REQUEST_STREAM)
    tasks = [asyncio.create_task(c) for c in (worker.fetch_loop(psub), worker.heartbeat_loop(), worker.engine_loop())]
    log.info("worker %d ready", worker.worker_id)
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await nc.drain()
