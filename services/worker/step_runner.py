"""The queue worker's engine thread, one step at a time: admits new requests, applies cancels, runs the engine step
(under StepGuard) and turns what it produced into a StepResult, the frames, acks and failures the event loop sends
while the next step computes (queue_worker.py).

It keeps the engine thread's own bookkeeping: the detokenizer each request's frames go to and how many of its
choices are still running, so a request is reported finished exactly when its last choice ends. Nothing here
touches NATS or the event loop.
"""

from __future__ import annotations

import copy
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TypeVar

from shared.request_limits import OutOfLimits
from shared.schemas import Cancel, WorkRequest
from services.worker.engine import Engine, SeqOutput
from services.worker.metrics import FailReason
from services.worker.publisher import abort_frame, step_frames
from services.worker.sequence import Sequence
from services.worker.step_guard import StepGuard

log = logging.getLogger("specmesh.worker")
T = TypeVar("T")


@dataclass(frozen=True)
class StepResult:
    """What one engine step leaves for the event loop: built in the engine thread, sent while the next step runs."""

    frames: list[tuple[str, bytes]]  # (detokenizer id, frame), in publishing order
    finished: list[str]  # requests whose last frame is among `frames`: acknowledged once it is published
    outputs: list[SeqOutput]  # for metrics, each with a copy of its sequence as it stood at the end of the step
    seconds: float | None  # the engine step's duration; None when the step only refused or cancelled requests
    num_preempted: int = 0
    # Requests ended with an error record among `frames` (refused, or failing a step): terminated, never redelivered.
    failed: list[tuple[str, FailReason]] = field(default_factory=list)


class StepRunner:
    """Steps the engine for the queue worker; engine thread only."""

    def __init__(self, engine: Engine, worker_id: int) -> None:
        self.engine = engine
        self.worker_id = worker_id
        # The detokenizer of each request in the engine, which its frames go to, and how many of its choices are
        # still running (its message is acknowledged when none is).
        self._detok_ids: dict[str, str] = {}
        self._num_live: dict[str, int] = {}
        self._guard: StepGuard = StepGuard(engine)

    def step(self, new: list[WorkRequest], cancels: list[Cancel]) -> StepResult:
        """Runs in the engine thread: admits, cancels and steps; returns what the event loop must send. A request
        the engine refuses, or that fails a step (StepGuard), ends with an error record and is terminated."""
        failed = [(request, reason) for request in new if (reason := self._admit(request)) is not None]
        finished: list[str] = []
        for cancel in cancels:
            finished += self._ended(self.engine.abort(cancel.request_id, cancel.choice))
        outputs: list[SeqOutput] = []
        frames: list[tuple[str, bytes]] = []
        seconds = None
        num_preempted = 0
        if self.engine.has_work():
            started = time.perf_counter()
            stepped, recovery = self._guard.run(self._engine_step)
            seconds = time.perf_counter() - started
            if stepped is not None:
                outputs, frames, num_preempted = stepped
                finished += self._ended([o.seq for o in outputs if o.seq.is_finished])
                # The event loop counts these while the next step changes the sequences: it gets copies.
                outputs = [replace(o, seq=copy.copy(o.seq)) for o in outputs]
            if recovery is not None:
                failed += [(request, FailReason.ENGINE_ERROR) for request in recovery.failed]
                for request in recovery.resumed:
                    self._num_live[request.request_id] = len(request.choices())
        ended = [request for request, _ in failed]
        frames = [
            (detok_id, abort_frame(group, self.worker_id, self.engine.step_no))
            for detok_id, group in _grouped(ended, lambda request: request.detok_id).items()
        ] + frames
        for request in ended:
            self._num_live.pop(request.request_id, None)
        for request_id in finished + [request.request_id for request in ended]:
            self._detok_ids.pop(request_id, None)
            self._guard.forget(request_id)
        failures = [(request.request_id, reason) for request, reason in failed]
        return StepResult(frames, finished, outputs, seconds, num_preempted, failures)

    def _admit(self, request: WorkRequest) -> FailReason | None:
        """Gives the request to the engine; the reason it was refused, or None."""
        try:
            seqs = self._guard.admit(request)
        except OutOfLimits as exc:
            log.warning("refusing request %s: %s is out of the model's limits: %s", request.request_id, exc.param, exc)
            return FailReason.OUT_OF_LIMITS
        except ValueError as exc:
            log.warning("refusing request %s: %s", request.request_id, exc)
            return FailReason.REFUSED
        self._detok_ids[request.request_id] = request.detok_id
        self._num_live[request.request_id] = len(seqs)
        return None

    def _engine_step(self) -> tuple[list[SeqOutput], list[tuple[str, bytes]], int]:
        """One engine step and its frames: (outputs, (detokenizer id, frame) in publishing order, preempted count).
        Touches no bookkeeping of this class, so that StepGuard can also run it to try a request alone."""
        outputs = self.engine.step()
        preempted = _grouped(self.engine.last_preempted, lambda seq: self._detok_ids[seq.request_id])
        groups = _grouped(outputs, lambda out: self._detok_ids[out.seq.request_id])
        frames = []
        for detok_id in groups.keys() | preempted.keys():
            group, evicted = groups.get(detok_id, []), preempted.get(detok_id, [])
            frames += [(detok_id, f) for f in step_frames(group, self.worker_id, self.engine.step_no, evicted)]
        return outputs, frames, len(self.engine.last_preempted)

    def _ended(self, seqs: list[Sequence]) -> list[str]:
        """The requests whose last running choices are among these finished sequences."""
        done = []
        for seq in seqs:
            self._num_live[seq.request_id] -= 1
            if not self._num_live[seq.request_id]:
                del self._num_live[seq.request_id]
                done.append(seq.request_id)
        return done


def _grouped(items: Iterable[T], detok_id_of: Callable[[T], str]) -> dict[str, list[T]]:
    """Groups a step's items by the detokenizer that owns their request: each gets its own frames."""
    groups: dict[str, list[T]] = defaultdict(list)
    for item in items:
        groups[detok_id_of(item)].append(item)
    return groups
