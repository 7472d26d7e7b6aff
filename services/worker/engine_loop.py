"""The engine process's side (engine_process.py spawns it): load the model, then take what the worker sent, step,
send the result, and wait only when there is nothing to step or no room to send another result."""

from __future__ import annotations

import os
import signal
import time
import traceback
import uuid
from multiprocessing.connection import Connection

import torch

from shared.config import EngineConfig
from shared.schemas import Cancel, SamplingParams, WorkRequest
from services.supervisor import die_with_parent
from services.worker.engine import Engine
from services.worker.engine_protocol import (
    MAX_UNSENT_STEPS, EngineFailed, EngineReady, Sent, Stop, Stopped,
)
from services.worker.hand_back import unfinished
from services.worker.step_runner import StepRunner

WARMUP_PROMPT = (0, 1, 2, 3)
WARMUP_TOKENS = 4


def serve(config: EngineConfig, worker_id: int, torch_threads: int, conn: Connection) -> None:
    """The engine process: loads the model, says EngineReady, then steps what the worker sends until Stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C and SIGTERM reach the worker, which drains us
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_parent(signal.SIGKILL)
    if os.getppid() == 1:  # the worker died before we could ask to die with it
        return
    try:
        if torch_threads:
            torch.set_num_threads(torch_threads)
        began = time.perf_counter()
        engine = Engine(config)
        warm_up(engine)
        conn.send(EngineReady(engine.vocab_size, engine.runner.cache.nbytes, time.perf_counter() - began))
        with torch.inference_mode():
            EngineLoop(engine, worker_id, conn).run()
    except (EOFError, BrokenPipeError):
        return  # the worker is gone
    except Exception:  # anything else: the worker must learn why before the process ends
        try:
            conn.send(EngineFailed(traceback.format_exc()))
        except OSError:
            pass
        raise SystemExit(1) from None


def warm_up(engine: Engine) -> None:
    """One short generation, so the first real request does not pay for lazy initialisation."""
    sampling = SamplingParams(temperature=0.0, max_tokens=WARMUP_TOKENS, ignore_eos=True)
    engine.add_request(WorkRequest(request_id=uuid.uuid4().hex, prompt_token_ids=WARMUP_PROMPT, sampling=sampling, created=0))
    while engine.has_work():
        engine.step()


class EngineLoop:
    def __init__(self, engine: Engine, worker_id: int, conn: Connection) -> None:
        self.engine = engine
        self.conn = conn
        self.stepper = StepRunner(engine, worker_id)
        self.new: list[WorkRequest] = []  # received, given to the engine at its next step
        self.cancels: list[Cancel] = []
        self.unsent = 0  # results sent down the pipe that the worker has not yet published

    def ready_to_step(self) -> bool:
        return self.unsent < MAX_UNSENT_STEPS and bool(self.new or self.cancels or self.engine.has_work())

    def run(self) -> None:
        """Until Stop: applies every message that came (blocking only while it cannot step), then steps."""
        while True:
            while not self.ready_to_step() or self.conn.poll():
                message = self.conn.recv()
                if isinstance(message, Stop):
                    not_started = [request.request_id for request in self.new]
                    self.conn.send(Stopped(unfinished(self.engine.scheduler), not_started))
                    return
                if isinstance(message, Sent):
                    self.unsent -= 1
                else:
                    self.new += message.new
                    self.cancels += message.cancels
            new, self.new = self.new, []
            cancels, self.cancels = self.cancels, []
            self.conn.send(self.stepper.step(new, cancels))
            self.unsent += 1
