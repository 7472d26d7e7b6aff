"""The worker's Prometheus metrics, fed from each engine step's outputs (labels: model, method, worker)."""

from __future__ import annotations

import collections
from enum import StrEnum

from prometheus_client import Counter, Gauge, Histogram

from services.worker.engine import Engine, SeqOutput

_LABELS = ["model", "method", "worker"]
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
ACCEPTANCE_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 9)

RUNNING = Gauge("specmesh_worker_running_sequences", "Sequences holding a cache slot", _LABELS)
WAITING = Gauge("specmesh_worker_waiting_sequences", "Sequences waiting for a cache slot", _LABELS)
KV_USAGE = Gauge("specmesh_worker_kv_cache_usage_ratio", "Share of the KV cache's blocks in use", _LABELS)
KV_BYTES = Gauge("specmesh_worker_kv_cache_bytes", "Memory of the KV cache", _LABELS)
STEP_SECONDS = Histogram("specmesh_worker_step_duration_seconds", "Duration of an engine step", _LABELS, buckets=STEP_BUCKETS)
BATCH_SIZE = Histogram("specmesh_worker_batch_size", "Sequences that produced output in a step", _LABELS, buckets=BATCH_BUCKETS)
PREEMPTIONS = Counter("specmesh_worker_preemptions", "Sequences evicted from the KV cache to be recomputed", _LABELS)
EMITTED = Counter("specmesh_worker_emitted_tokens", "Tokens emitted (accepted drafts and target tokens)", _LABELS)
PROMPT_TOKENS = Counter("specmesh_worker_prompt_tokens", "Prompt tokens of the requests taken", _LABELS)
FINISHED = Counter("specmesh_worker_finished_requests", "Requests finished, by reason", _LABELS + ["reason"])
DRAFTS = Counter("specmesh_worker_spec_decode_drafts", "Sequence-steps that verified at least one draft", _LABELS)
DRAFT_TOKENS = Counter("specmesh_worker_spec_decode_draft_tokens", "Draft tokens verified", _LABELS)
ACCEPTED = Counter("specmesh_worker_spec_decode_accepted_tokens", "Draft tokens accepted", _LABELS)
ACCEPTED_PER_POS = Counter(
    "specmesh_worker_spec_decode_accepted_tokens_per_pos", "Draft tokens accepted, by draft position", _LABELS + ["position"]
)
DRAFTED_PER_POS = Counter(
    "specmesh_worker_spec_decode_draft_tokens_per_pos", "Draft tokens verified, by draft position", _LABELS + ["position"]
)
ACCEPTANCE_LENGTH = Histogram(
    "specmesh_worker_spec_decode_acceptance_length", "Tokens emitted per sequence-step that verified drafts",
    _LABELS, buckets=ACCEPTANCE_BUCKETS,
)
FRAMES = Counter("specmesh_worker_frames_published", "Frames published, by kind", _LABELS + ["kind"])
FRAME_BYTES = Counter("specmesh_worker_frame_bytes", "Bytes of frames published, by kind", _LABELS + ["kind"])
REQUESTS_TAKEN = Counter("specmesh_worker_requests_taken", "Requests taken from the work queue", _LABELS)
REQUESTS_HANDED_BACK = Counter(
    "specmesh_worker_requests_handed_back", "Unfinished requests re-queued with their progress at shutdown", _LABELS
)

FAILED_REQUESTS = Counter(
    "specmesh_worker_failed_requests",
    "Work-queue messages the worker terminated without serving them to the end, by reason", _LABELS + ["reason"],
)
TAKE_OVERS = Counter(
    "specmesh_worker_take_overs",
    "Requests that came back from another worker (it died, stalled or drained), by what became of them here",
    _LABELS + ["outcome"],
)
DEAD_LETTERS = Counter(
    "specmesh_worker_dead_letters",
    "Requests moved to the dead-letter subject after the work queue delivered them max_deliver times", _LABELS,
)


class FailReason(StrEnum):
    """The `reason` label of FAILED_REQUESTS: a closed set, so no client value becomes a label."""

    MALFORMED = "malformed"  # not a WorkRequest: bad JSON, or a field outside the request schema
    NO_DETOKENIZER = "no_detokenizer"  # names no detokenizer to send its output to
    OUT_OF_LIMITS = "out_of_limits"  # outside the model: a token id past the vocabulary, no room in the context
    REFUSED = "refused"  # the engine refused it for another reason
    ENGINE_ERROR = "engine_error"  # an engine step raised and the request failed it alone (or none could be blamed)


class WorkerMetrics:
    def __init__(self, engine: Engine, model: str, worker_id: int) -> None:
        self.engine = engine
        self.labels = {"model": model, "method": engine.config.speculative.method, "worker": str(worker_id)}
        self._children: dict[tuple, object] = {}
        KV_BYTES.labels(**self.labels).set(engine.runner.cache.nbytes)
        RUNNING.labels(**self.labels).set_function(lambda: len(engine.scheduler.running))
        WAITING.labels(**self.labels).set_function(lambda: len(engine.scheduler.waiting))
        KV_USAGE.labels(**self.labels).set_function(lambda: engine.kv_usage)

    def counter(self, metric, **extra):
        """The metric's child for this worker (and the extra labels), looked up once: prometheus_client's labels()
        takes a lock and builds its key on every call, which a step's metrics would pay dozens of times."""
        key = (metric, *extra.items())
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(**self.labels, **extra)
        return child

    def observe_request(self, num_prompt_tokens: int) -> None:
        self.counter(REQUESTS_TAKEN).inc()
        self.counter(PROMPT_TOKENS).inc(num_prompt_tokens)

    def observe_step(self, outputs: list[SeqOutput], seconds: float) -> None:
        """A step's metrics, summed over its outputs first: one update per metric (and per draft position), not
        one per sequence."""
        self.counter(STEP_SECONDS).observe(seconds)
        if not outputs:
            return
        self.counter(BATCH_SIZE).observe(len(outputs))
        self.counter(EMITTED).inc(sum(len(out.tokens) for out in outputs))
        finished = collections.Counter(out.finish_reason.name.lower() for out in outputs if out.seq.is_finished)
        for reason, count in finished.items():
            self.counter(FINISHED, reason=reason).inc(count)
        drafted = [out for out in outputs if out.draft_tokens]
        if not drafted:
            return
        self.counter(DRAFTS).inc(len(drafted))
        self.counter(DRAFT_TOKENS).inc(sum(len(out.draft_tokens) for out in drafted))
        self.counter(ACCEPTED).inc(sum(out.num_accepted for out in drafted))
        acceptance = self.counter(ACCEPTANCE_LENGTH)
        drafted_at = [0] * max(len(out.draft_tokens) for out in drafted)  # per draft position
        accepted_at = [0] * len(drafted_at)
        for out in drafted:
            acceptance.observe(out.num_accepted + 1)
            for position in range(len(out.draft_tokens)):
                drafted_at[position] += 1
            for position in range(out.num_accepted):
                accepted_at[position] += 1
        for position, count in enumerate(drafted_at):
            self.counter(DRAFTED_PER_POS, position=str(position)).inc(count)
            if accepted_at[position]:
                self.counter(ACCEPTED_PER_POS, position=str(position)).inc(accepted_at[position])

    def observe_frame(self, kind: str, size: int) -> None:
        self.counter(FRAMES, kind=kind).inc()
        self.counter(FRAME_BYTES, kind=kind).inc(size)
