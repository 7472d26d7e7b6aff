"""The engine process's step (engine_process.py): admits new requests, applies cancels, runs the engine step (under
StepGuard) and turns what it produced into a StepResult, the frames, acks, failures and metrics the worker's event
loop sends while the next step computes (queue_worker.py).

It keeps the engine side's own bookkeeping: the detokenizer each request's frames go to and how many of its
choices are still running, so a request is reported finished exactly when its last choice ends. Nothing here
touches NATS or the event loop.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import TypeVar

from shared.frames import FinishReason
from shared.request_limits import OutOfLimits
from shared.schemas import Cancel, WorkRequest
from services.worker.engine.engine import Engine, SeqOutput
from services.worker.engine.handoff import HandoffMismatch
from services.worker.engine_protocol import Gauges, StepResult, StepStats
from services.worker.fail_reason import FailReason
from services.worker.publisher import abort_frame, step_frames
from services.worker.engine.sequence import Sequence
from services.worker.step_guard import StepGuard

log = logging.getLogger("specmesh.worker")
T = TypeVar("T")
STOP_STRING = "stop_string"  # Cancel.reason of a request the detokenizer ended at one of its stop strings
STOP_STRING_FINISH = FinishReason.STOP  # the finish reason the client is told, and the metrics count it under


class StepRunner:
    """Steps the engine for the queue worker; engine process only."""

    def __init__(self, engine: Engine, worker_id: int) -> None:
        self.engine = engine
        self.worker_id = worker_id
        # The detokenizer of each request in the engine, which its frames go to, and how many of its choices are
        # still running (its message is acknowledged when none is).
        self._detok_ids: dict[str, str] = {}
        self._num_live: dict[str, int] = {}
        self._guard: StepGuard = StepGuard(engine)
        self._lookups = (0, 0)  # the scheduler's prefix cache counters at the last step
        self._recomputed = 0  # handed-off choices of this step's new requests whose handoff did not fit
        # The scheduler's counts of handed-off choices admitted with their KV, and recomputed because the cached
        # blocks they start from were gone, at the last step
        self._imported_before = self._gone_before = 0

    def step(
        self, new: list[WorkRequest], cancels: list[Cancel], handoffs: dict[str, bytes] | None = None
    ) -> StepResult:
        """Admits, cancels and steps; returns what the event loop must send. A request the engine refuses, or that
        fails a step (StepGuard), ends with an error record and is terminated. `handoffs`: the exported state of
        new requests handed to this decode worker, by request id."""
        handoffs = handoffs or {}
        self._recomputed = 0
        failed = [
            (request, reason) for request in new
            if (reason := self._admit(request, handoffs.get(request.request_id))) is not None
        ]
        finished: list[str] = []
        released: list[str] = []
        stopped: list[Sequence] = []  # ended by a stop string: finished, as far as the client is concerned
        for cancel in cancels:
            aborted = self.engine.abort(cancel.request_id, cancel.choice)
            if cancel.reason == STOP_STRING:
                stopped += aborted
            ended = self._ended(aborted)
            if cancel.worker_id is None:
                finished += ended
            else:  # reported whether or not the engine still held it: the event loop waits for this
                released.append(cancel.request_id)
        frames: list[tuple[str, bytes]] = []
        stats = seconds = None
        num_preempted = 0
        if self.engine.has_work():
            started = time.perf_counter()
            stepped, recovery = self._guard.run(self._engine_step)
            seconds = time.perf_counter() - started
            outputs: list[SeqOutput] = []
            if stepped is not None:
                outputs, frames, num_preempted = stepped
                finished += self._ended([o.seq for o in outputs if o.seq.is_finished])
            stats = step_stats(outputs)  # a step that failed still counts as a step, with no outputs
            stats.prefix_queries, stats.prefix_hits = self._lookups_since_last_step()
            if recovery is not None:
                failed += [(request, FailReason.ENGINE_ERROR) for request in recovery.failed]
                for request in recovery.resumed:
                    self._num_live[request.request_id] = len(request.choices())
        if stopped:  # with no step when the engine held nothing else (a waiting sequence leaves it at once)
            stats = stats or StepStats()
            record_finished(stats, stopped, STOP_STRING_FINISH)
        ended = [request for request, _ in failed]
        frames = [
            (detok_id, abort_frame(group, self.worker_id, self.engine.step_no))
            for detok_id, group in _grouped(ended, lambda request: request.detok_id).items()
        ] + frames
        for request in ended:
            self._num_live.pop(request.request_id, None)
        for request_id in finished + released + [request.request_id for request in ended]:
            self._detok_ids.pop(request_id, None)
            self._guard.forget(request_id)
        failures = [(request.request_id, reason) for request, reason in failed]
        handed_off = self._take_handoffs()  # before the gauges: what a prefill worker hands off it holds no more
        scheduler = self.engine.scheduler
        gauges = Gauges(len(scheduler.running), len(scheduler.waiting), self.engine.kv_usage)
        step = self.engine.step_no if seconds is not None else 0
        stored, removed = scheduler.blocks.cache.take_journal()
        recomputed = self._recomputed + scheduler.handoffs_recomputed - self._gone_before
        imported = scheduler.handoffs_imported - self._imported_before
        self._gone_before, self._imported_before = scheduler.handoffs_recomputed, scheduler.handoffs_imported
        return StepResult(
            step, frames, finished, gauges, stats, seconds, num_preempted, failures, stored, removed, handed_off,
            recomputed, imported, released,
        )

    def _take_handoffs(self) -> list[tuple[str, list[tuple[int, list[int], int]], int, bytes]]:
        """The requests the engine (a prefill worker's) exported this step, which leave its bookkeeping here."""
        handed = []
        for seqs, payload in self.engine.hand_off_ready():
            request_id = seqs[0].request_id
            self._num_live.pop(request_id, None)
            self._detok_ids.pop(request_id, None)
            self._guard.forget(request_id)
            progress = [(s.choice, list(s.output_ids), s.target_seq_no) for s in seqs]
            handed.append((request_id, progress, seqs[0].sampling.seed, payload))
        return handed

    def _lookups_since_last_step(self) -> tuple[int, int]:
        """The prefix cache's (queries, hits) in tokens since the last call."""
        scheduler = self.engine.scheduler
        queries, hits = scheduler.prefix_queries - self._lookups[0], scheduler.prefix_hits - self._lookups[1]
        self._lookups = (scheduler.prefix_queries, scheduler.prefix_hits)
        return queries, hits

    def _admit(self, request: WorkRequest, handoff: bytes | None = None) -> FailReason | None:
        """Gives the request to the engine; the reason it was refused, or None. A handoff that does not fit is
        dropped and the request recomputed from its progress (counted)."""
        try:
            try:
                seqs = self._guard.admit(request, handoff)
            except HandoffMismatch as exc:
                log.warning("recomputing request %s: its handoff does not fit: %s", request.request_id, exc)
                self._recomputed += len(request.choices())
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


def step_stats(outputs: list[SeqOutput]) -> StepStats:
    """A step's outputs summed for the metrics, in the engine process: the event loop gets counts, not sequences."""
    stats = StepStats(batch_size=len(outputs), emitted=sum(len(out.tokens) for out in outputs))
    for out in outputs:
        if out.seq.is_finished:
            record_finished(stats, [out.seq], out.finish_reason)
        if not out.draft_tokens:
            continue
        stats.acceptance_lengths.append(out.num_accepted + 1)
        missing = len(out.draft_tokens) - len(stats.drafted_at)
        if missing > 0:
            stats.drafted_at += [0] * missing
            stats.accepted_at += [0] * missing
        for position in range(len(out.draft_tokens)):
            stats.drafted_at[position] += 1
        for position in range(out.num_accepted):
            stats.accepted_at[position] += 1
    return stats


def record_finished(stats: StepStats, seqs: list[Sequence], reason: FinishReason) -> None:
    """Counts the sequences as finished for `reason`, with their phases and token counts on this worker."""
    name = reason.name.lower()
    stats.finished[name] = stats.finished.get(name, 0) + len(seqs)
    now = time.monotonic()
    for seq in seqs:
        emitted_here = len(seq.output_ids) - seq.timeline.outputs_before
        stats.finished_phases.append((*seq.timeline.phases(now), len(seq.prompt_ids), emitted_here))


def _grouped(items: Iterable[T], detok_id_of: Callable[[T], str]) -> dict[str, list[T]]:
    """Groups a step's items by the detokenizer that owns their request: each gets its own frames."""
    groups: dict[str, list[T]] = defaultdict(list)
    for item in items:
        groups[detok_id_of(item)].append(item)
    return groups
