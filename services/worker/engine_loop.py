"""The engine process's side (engine_process.py spawns it): load the model, then take what the worker sent, step,
send the result, and wait only when there is nothing to step or MAX_UNSENT_STEPS results are not yet published."""

from __future__ import annotations

import os
import signal
import time
import traceback
import uuid
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch

from shared.config import EngineConfig
from shared.schemas import Cancel, SamplingParams, WorkRequest
from services.cpu_affinity import pin
from services.supervisor import die_with_parent
from services.worker.engine.engine import Engine
from services.worker.engine_protocol import (
    MAX_UNSENT_STEPS, Counters, EngineFailed, EngineReady, Stop, Stopped, Work, decode, encode,
)
from services.worker.hand_back import unfinished
from services.worker.step_runner import StepRunner

WARMUP_PROMPT = (0, 1, 2, 3)
WARMUP_TOKENS = 4
# How often an engine waiting for room (its results unpublished) looks at the loop's count again. Only a stalled
# connection keeps it waiting: the loop publishes a step well within the next step's time.
ROOM_POLL_S = 0.0005


def serve(
    config: EngineConfig, worker_id: int, torch_threads: int, cpus: frozenset[int] | None, inbox: Connection,
    outbox: Connection, counters: Counters,
) -> None:
    """The engine process: loads the model, says EngineReady, then steps what the worker sends until Stop. On
    `cpus` if given, with one torch thread per CPU unless torch_threads says otherwise."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C and SIGTERM reach the worker, which drains us
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_parent(signal.SIGKILL)
    if os.getppid() == 1:  # the worker died before we could ask to die with it
        return
    pin(cpus)
    try:
        if torch_threads or cpus:
            torch.set_num_threads(torch_threads or len(cpus))
        began = time.perf_counter()
        engine = Engine(config)
        warm_up(engine)
        outbox.send_bytes(encode(EngineReady(
            engine.vocab_size, engine.runner.cache.nbytes, time.perf_counter() - began, engine.revision,
        )))
        with torch.inference_mode():
            EngineLoop(engine, worker_id, inbox, outbox, counters).run()
    except (EOFError, BrokenPipeError):
        return  # the worker is gone
    except Exception:  # anything else: the worker must learn why before the process ends
        try:
            outbox.send_bytes(encode(EngineFailed(traceback.format_exc())))
        except OSError:
            pass
        raise SystemExit(1) from None


def warm_up(engine: Engine) -> None:
    """One short generation, so the first real request does not pay for lazy initialisation (a prefill worker's is
    exported, as its requests will be, and dropped)."""
    sampling = SamplingParams(temperature=0.0, max_tokens=WARMUP_TOKENS, ignore_eos=True)
    engine.add_request(WorkRequest(request_id=uuid.uuid4().hex, prompt_token_ids=WARMUP_PROMPT, sampling=sampling, created=0))
    while engine.has_work():
        engine.step()
        engine.hand_off_ready()


class EngineLoop:
    def __init__(self, engine: Engine, worker_id: int, inbox: Connection, outbox: Connection, counters: Counters) -> None:
        self.engine = engine
        self.inbox = inbox
        self.outbox = outbox
        self.counters = counters
        self.stepper = StepRunner(engine, worker_id)
        self.new: list[WorkRequest] = []  # received, given to the engine at its next step
        self.cancels: list[Cancel] = []
        self.handoffs: dict[str, bytes] = {}  # of new requests handed to this (decode) worker
        self.received = 0  # messages taken from the inbox
        self.sent = 0  # step results sent to the loop

    def run(self) -> None:
        """Until Stop: applies every message that came, waits while there is nothing to step or no room, steps."""
        while True:
            # The loop counts a message once it is in the pipe, so a message taken while idle may be counted later:
            # only a count ahead of ours says that one waits.
            if self.counters.orders > self.received or not (self.new or self.cancels or self.engine.has_work()):
                self._wait_for_message()
                if not self._take(decode(self.inbox.recv_bytes())):  # blocks only when idle: a message waits otherwise
                    return
                continue
            if self.sent - self.counters.published >= MAX_UNSENT_STEPS:
                self.inbox.poll(ROOM_POLL_S)  # a message (a cancel, Stop) ends the wait at once
                continue
            new, self.new = self.new, []
            cancels, self.cancels = self.cancels, []
            handoffs, self.handoffs = self.handoffs, {}
            self.outbox.send_bytes(encode(self.stepper.step(new, cancels, handoffs)))
            self.sent += 1

    def _wait_for_message(self) -> None:
        """Returns once a message is in the inbox; raises if a process the runner needs (a tensor-parallel rank)
        died meanwhile, so an idle engine fails as loudly as a stepping one."""
        runner = self.engine.runner
        while runner.sentinels and not self.inbox.poll():
            wait([self.inbox, *runner.sentinels])
            runner.check_alive()

    def _take(self, message: Work | Stop) -> bool:
        """Applies one message; False for Stop, which it answers."""
        self.received += 1
        if isinstance(message, Stop):
            not_started = [request.request_id for request in self.new]
            self.outbox.send_bytes(encode(Stopped(unfinished(self.engine.scheduler), not_started)))
            return False
        self.new += message.new
        self.handoffs |= message.handoffs
        for request_id, name in message.handoff_files.items():
            path = Path(name)
            self.handoffs[request_id] = path.read_bytes()
            path.unlink()
        self.cancels += message.cancels
        return True
