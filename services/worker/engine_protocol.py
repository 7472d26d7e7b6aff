"""What passes between a worker's event loop and its engine process (engine_process.py): a pipe each way and two
counters in shared memory.

Loop -> engine (the inbox): Work (new requests and cancels), Stop.
Engine -> loop (the outbox): EngineReady once, then a StepResult per step, then Stopped; EngineFailed instead if it
raises. The counters (Counters) spare the engine a system call per step: it reads its inbox only when `orders` says
a message waits there, and learns from `published` how far the loop has published its steps.
Everything here is plain data and imports no torch, so the event loop's side stays light. encode() and decode() carry
it over the pipes: a StepResult, sent every step, as a tuple of builtins in marshal's format; the rest pickled.
"""

from __future__ import annotations

import marshal
import pickle
from dataclasses import dataclass, field
from multiprocessing.context import SpawnContext

from shared.schemas import Cancel, ChoiceProgress, SamplingParams, WorkRequest
from services.worker.fail_reason import FailReason

# Steps taken by the engine process and not yet published by the event loop, the one computing included: the engine
# computes ahead while the loop publishes, and waits once it is this far ahead (a stalled NATS connection).
MAX_UNSENT_STEPS = 4


@dataclass(frozen=True)
class Work:
    """Requests taken from the queue and cancels, for the engine to apply before its next step."""

    new: list[WorkRequest] = field(default_factory=list)
    cancels: list[Cancel] = field(default_factory=list)
    handoffs: dict[str, bytes] = field(default_factory=dict)  # by request id: a prefill worker's export of it
    handoff_files: dict[str, str] = field(default_factory=dict)  # the same, as the engine gets them: in spool files


@dataclass(frozen=True)
class Stop:
    """Finish the step in progress, answer Stopped and exit."""


class Counters:
    """Two counters in shared memory, each written by the loop only and read by the engine: `orders`, the messages
    the loop has put in the engine's inbox, and `published`, the engine steps whose results the loop has sent on.
    A stale read is harmless: the engine sees a message or some room one step later."""

    ORDERS, PUBLISHED = 0, 1

    def __init__(self, context: SpawnContext) -> None:
        self._values = context.RawArray("q", 2)  # int64, no lock: one writer each

    @property
    def orders(self) -> int:
        return self._values[self.ORDERS]

    @property
    def published(self) -> int:
        return self._values[self.PUBLISHED]

    def ordered(self) -> None:
        self._values[self.ORDERS] += 1

    def step_published(self) -> None:
        self._values[self.PUBLISHED] += 1


@dataclass(frozen=True)
class EngineReady:
    """The model is loaded and warmed up."""

    vocab_size: int
    kv_cache_bytes: int
    seconds: float  # loading and warming up
    revision: str  # the model revision its prefix cache's block names start from


@dataclass(slots=True)
class Gauges:
    """The scheduler's state at the end of a step."""

    running: int
    waiting: int
    kv_usage: float  # share of the KV cache's blocks in use


@dataclass(slots=True)
class StepStats:
    """A step's outputs summed for the metrics (metrics.WorkerMetrics.observe_step): one update per metric."""

    batch_size: int = 0  # sequences that produced output
    emitted: int = 0  # tokens emitted, accepted drafts included
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> sequences
    drafted_at: list[int] = field(default_factory=list)  # per draft position: sequences that verified a draft there
    accepted_at: list[int] = field(default_factory=list)  # per draft position: of those, accepted
    acceptance_lengths: list[int] = field(default_factory=list)  # per sequence that verified drafts: 1 + accepted
    prefix_queries: int = 0  # tokens the step's admissions looked up in the prefix cache
    prefix_hits: int = 0  # of those, found cached
    # Per sequence finished: its (queue, prefill, decode) seconds (engine/timeline.py), prompt and output tokens
    finished_phases: list[tuple[float, float, float, int, int]] = field(default_factory=list)


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs the engine process a few microseconds a step
class StepResult:
    """What one engine step leaves for the event loop: built in the engine process, sent while the next step runs."""

    step: int  # the engine's step number (0: the step only refused or cancelled requests)
    frames: list[tuple[str, bytes]]  # (detokenizer id, frame), in publishing order
    finished: list[str]  # requests whose last frame is among `frames`: acknowledged once it is published
    gauges: Gauges
    stats: StepStats | None  # None when no engine step ran and no stop string ended a request
    seconds: float | None  # the engine step's duration; None when no engine step ran
    num_preempted: int = 0
    # Requests ended with an error record among `frames` (refused, or failing a step): terminated, never redelivered.
    failed: list[tuple[str, FailReason]] = field(default_factory=list)
    # The prefix cache's block names stored and evicted by the step (cache events for prefix-aware routing)
    stored: list[bytes] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)
    # A prefill worker's requests handed off this step: (request id, each unfinished choice's (index, output token
    # ids, next TARGET record number), the seed, the handoff's bytes); acknowledged once a decode worker has them
    handed_off: list[tuple[str, list[tuple[int, list[int], int]], int, bytes]] = field(default_factory=list)
    # A decode worker's handed-off choices admitted this step: recomputed (their handoff did not fit, or the cached
    # blocks it starts from were gone), or with the handoff's KV
    handoffs_recomputed: int = 0
    handoffs_imported: int = 0
    # Requests released to another worker (a Cancel with worker_id): the engine has dropped whatever it ran of them;
    # never among `finished`, whose acknowledgement would settle the new owner's message
    released: list[str] = field(default_factory=list)

    def to_wire(self) -> tuple:
        """The result as nested tuples of builtins (decode() takes it back): encoded in a few microseconds, where
        pickling the dataclasses took 40-50 in the engine process after a step, one of its largest costs besides
        the model."""
        gauges, stats = self.gauges, self.stats
        return (
            self.step, self.frames, self.finished, (gauges.running, gauges.waiting, gauges.kv_usage),
            None if stats is None else (
                stats.batch_size, stats.emitted, stats.finished, stats.drafted_at, stats.accepted_at,
                stats.acceptance_lengths, stats.prefix_queries, stats.prefix_hits, stats.finished_phases,
            ),
            self.seconds, self.num_preempted, [(request_id, str(reason)) for request_id, reason in self.failed],
            self.stored, self.removed, self.handed_off, self.handoffs_recomputed, self.handoffs_imported, self.released,
        )

    @classmethod
    def from_wire(cls, wire: tuple) -> StepResult:
        (step, frames, finished, gauges, stats, seconds, num_preempted, failed, stored, removed, handed_off,
         recomputed, imported, released) = wire
        if stats is not None:
            stats = StepStats(*stats)
        return cls(
            step, frames, finished, Gauges(*gauges), stats, seconds, num_preempted,
            [(request_id, FailReason(reason)) for request_id, reason in failed], stored, removed, handed_off,
            recomputed, imported, released,
        )


@dataclass(frozen=True)
class Unfinished:
    """A request's unfinished choices when the engine stopped, as a draining worker hands it back (hand_back.py)."""

    progress: tuple[ChoiceProgress, ...]  # by choice index
    sampling: SamplingParams  # with the seed the engine drew, if the request had none


@dataclass(frozen=True)
class Stopped:
    """The engine stopped after publishing every step it took; what it had not finished, by request id."""

    unfinished: dict[str, Unfinished]
    not_started: list[str]  # requests received and never given to the engine


@dataclass(frozen=True)
class EngineFailed:
    """The engine process raised; it exits after sending this."""

    error: str  # the traceback


# A pickle (protocol 2 and later) opens with the PROTO opcode; marshal's first byte is a type code, an ASCII letter or
# sign that may carry its 0x80 reference flag, never 0x80 alone. decode() tells the two formats apart by it.
PICKLE_PROTO = pickle.PROTO[0]


def encode(message: object) -> bytes:
    """A message's bytes for either pipe (Connection.send_bytes). A StepResult goes as its wire tuple in marshal's
    format: after a model step, with the caches cold, marshal's small encoder costs the engine ~6 us less a step
    than pickle's. Both ends are the same interpreter (the worker spawns the engine), as marshal requires."""
    if isinstance(message, StepResult):
        return marshal.dumps(message.to_wire())
    return pickle.dumps(message, pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> object:
    """The message encode() wrote."""
    if data[0] == PICKLE_PROTO:
        return pickle.loads(data)
    return StepResult.from_wire(marshal.loads(data))
