"""The worker's Prometheus metrics, fed from each engine step's summary (labels: model, method, worker)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from services.worker.engine_protocol import Gauges, StepStats

_LABELS = ["model", "method", "worker"]
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
ACCEPTANCE_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 9)
PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TOKEN_COUNT_BUCKETS = tuple(2**i for i in range(18))  # 1 .. 131072

RUNNING = Gauge("specmesh_worker_running_sequences", "Sequences holding a cache slot", _LABELS)
WAITING = Gauge("specmesh_worker_waiting_sequences", "Sequences waiting for a cache slot", _LABELS)
KV_USAGE = Gauge("specmesh_worker_kv_cache_usage_ratio", "Share of the KV cache's blocks in use", _LABELS)
KV_BYTES = Gauge("specmesh_worker_kv_cache_bytes", "Memory of the KV cache", _LABELS)
STEP_SECONDS = Histogram("specmesh_worker_step_duration_seconds", "Duration of an engine step", _LABELS, buckets=STEP_BUCKETS)
BATCH_SIZE = Histogram("specmesh_worker_batch_size", "Sequences that produced output in a step", _LABELS, buckets=BATCH_BUCKETS)
PREEMPTIONS = Counter("specmesh_worker_preemptions", "Sequences evicted from the KV cache to be recomputed", _LABELS)
EMITTED = Counter("specmesh_worker_emitted_tokens", "Tokens emitted (accepted drafts and target tokens)", _LABELS)
PROMPT_TOKENS = Counter("specmesh_worker_prompt_tokens", "Prompt tokens of the requests taken", _LABELS)
FINISHED = Counter(
    "specmesh_worker_finished_requests",
    "Sequences finished (one per choice of a request), by finish reason: a stop string's end counts as stop, "
    "a cancel by the client not at all",
    _LABELS + ["reason"],
)
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
PREFIX_QUERIES = Counter(
    "specmesh_worker_prefix_cache_queries", "Tokens admitted sequences had to compute, looked up in the prefix cache",
    _LABELS,
)
PREFIX_HITS = Counter(
    "specmesh_worker_prefix_cache_hits", "Of the tokens looked up in the prefix cache, those found computed", _LABELS
)
BAD_WORKER_STATES = Counter(
    "specmesh_worker_bad_worker_states", "Other workers' states that could not be decoded and were dropped", _LABELS
)
ROUTED_MOVED = Counter(
    "specmesh_worker_routed_requests_moved",
    "Routed requests moved to the shared queue: delivered before (a crash), adopted from a worker gone, or a drain's "
    "backlog", _LABELS + ["delivered_before"],
)
FRAMES = Counter("specmesh_worker_frames_published", "Frames published, by kind", _LABELS + ["kind"])
FRAME_BYTES = Counter("specmesh_worker_frame_bytes", "Bytes of frames published, by kind", _LABELS + ["kind"])
REQUESTS_TAKEN = Counter("specmesh_worker_requests_taken", "Requests taken from the work queue", _LABELS)
REQUESTS_RELEASED = Counter(
    "specmesh_worker_requests_released",
    "Requests dropped because another worker took them over while this one still ran them (it had stalled)", _LABELS,
)
REQUESTS_HANDED_BACK = Counter(
    "specmesh_worker_requests_handed_back", "Unfinished requests re-queued with their progress at shutdown", _LABELS
)
HANDOFFS = Counter(
    "specmesh_worker_handoffs",
    "Prefill/decode handoffs, by outcome: sent (a prefill worker's requests, with their KV), sent_without_kv (the "
    "transfer failed: recomputed there), imported and recomputed (a decode worker's choices, each counted once, as "
    "it is admitted)", _LABELS + ["outcome"],
)
HANDOFF_BYTES = Counter("specmesh_worker_handoff_bytes", "KV handoff bytes sent to decode workers", _LABELS)
HANDOFF_SECONDS = Histogram(
    "specmesh_worker_handoff_duration_seconds", "From a request's export to a decode worker holding it", _LABELS,
    buckets=STEP_BUCKETS,
)
HANDOFF_TRANSFERS_HELD = Gauge(
    "specmesh_worker_handoff_transfers_held",
    "KV transfers a decode worker holds for requests still on their way to it (each holds room for one)", _LABELS,
)
HANDOFF_FAILURES = Counter(
    "specmesh_worker_handoff_transfer_failures", "KV transfers that failed, by reason (gone, busy, failed)",
    _LABELS + ["reason"],
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
ENGINE_STALLS = Counter(
    "specmesh_worker_engine_stalls",
    "Times the engine, holding requests, returned no step for --engine-stall-timeout (its requests then left it)",
    _LABELS,
)
# A finished sequence's phases on this worker (engine/timeline.py), as vLLM's request_*_time_seconds: one choice of a
# request each, observed when the engine ends it (max_tokens, a stop token) or when the detokenizer's cancel for a
# stop string reaches it (its decode, then, runs to that moment, and counts the tokens generated until then); one
# the client cancelled is not, and a handed-off one only on the worker that finishes it.
QUEUE_TIME = Histogram(
    "specmesh_worker_request_queue_time_seconds", "From reaching the engine to its first cache slot", _LABELS,
    buckets=PHASE_BUCKETS,
)
PREFILL_TIME = Histogram(
    "specmesh_worker_request_prefill_time_seconds", "From its first cache slot to its first token on this worker",
    _LABELS, buckets=PHASE_BUCKETS,
)
DECODE_TIME = Histogram(
    "specmesh_worker_request_decode_time_seconds", "From its first token on this worker to its last", _LABELS,
    buckets=PHASE_BUCKETS,
)
REQUEST_PROMPT_TOKENS = Histogram(
    "specmesh_worker_request_prompt_tokens", "Prompt tokens of each finished sequence", _LABELS,
    buckets=TOKEN_COUNT_BUCKETS,
)
REQUEST_GENERATION_TOKENS = Histogram(
    "specmesh_worker_request_generation_tokens",
    "Output tokens of each finished sequence emitted on this worker (not those of a worker it took over from)", _LABELS,
    buckets=TOKEN_COUNT_BUCKETS,
)
DEAD_LETTERS = Counter(
    "specmesh_worker_dead_letters",
    "Requests moved to the dead-letter subject after the work queue delivered them max_deliver times", _LABELS,
)


class WorkerMetrics:
    def __init__(self, model: str, method: str, worker_id: int) -> None:
        self.labels = {"model": model, "method": method, "worker": str(worker_id)}
        self._children: dict[tuple, object] = {}

    def observe_engine(self, kv_cache_bytes: int) -> None:
        self.child(KV_BYTES).set(kv_cache_bytes)

    def observe_gauges(self, gauges: Gauges) -> None:
        self.child(RUNNING).set(gauges.running)
        self.child(WAITING).set(gauges.waiting)
        self.child(KV_USAGE).set(gauges.kv_usage)

    def child(self, metric, **extra):
        """The metric's child for this worker (and the extra labels), looked up once: prometheus_client's labels()
        takes a lock and builds its key on every call, which a step's metrics would pay dozens of times."""
        key = (metric, *extra.items())
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(**self.labels, **extra)
        return child

    def observe_request(self, num_prompt_tokens: int) -> None:
        self.child(REQUESTS_TAKEN).inc()
        self.child(PROMPT_TOKENS).inc(num_prompt_tokens)

    def observe_step(self, stats: StepStats, seconds: float | None) -> None:
        """seconds: None when the engine took no step (a stop string ended a request that was only waiting)."""
        if seconds is not None:
            self.child(STEP_SECONDS).observe(seconds)
        if stats.prefix_queries:
            self.child(PREFIX_QUERIES).inc(stats.prefix_queries)
            self.child(PREFIX_HITS).inc(stats.prefix_hits)
        for reason, count in stats.finished.items():
            self.child(FINISHED, reason=reason).inc(count)
        for queue, prefill, decode, num_prompt, num_output in stats.finished_phases:
            self.child(QUEUE_TIME).observe(queue)
            self.child(PREFILL_TIME).observe(prefill)
            self.child(DECODE_TIME).observe(decode)
            self.child(REQUEST_PROMPT_TOKENS).observe(num_prompt)
            self.child(REQUEST_GENERATION_TOKENS).observe(num_output)
        if not stats.batch_size:
            return
        self.child(BATCH_SIZE).observe(stats.batch_size)
        self.child(EMITTED).inc(stats.emitted)
        if not stats.acceptance_lengths:
            return
        self.child(DRAFTS).inc(len(stats.acceptance_lengths))
        self.child(DRAFT_TOKENS).inc(sum(stats.drafted_at))
        self.child(ACCEPTED).inc(sum(stats.accepted_at))
        acceptance = self.child(ACCEPTANCE_LENGTH)
        for length in stats.acceptance_lengths:
            acceptance.observe(length)
        for position, count in enumerate(stats.drafted_at):
            self.child(DRAFTED_PER_POS, position=str(position)).inc(count)
            if stats.accepted_at[position]:
                self.child(ACCEPTED_PER_POS, position=str(position)).inc(stats.accepted_at[position])

    def observe_frame(self, kind: str, size: int) -> None:
        self.child(FRAMES, kind=kind).inc()
        self.child(FRAME_BYTES, kind=kind).inc(size)
