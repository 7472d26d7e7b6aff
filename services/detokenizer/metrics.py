"""The detokenizer's Prometheus metrics (default registry, served on its /metrics).

Apart from the handlers that count them, so that every name the dashboards (k8s/) read is found in one place.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from shared.frames import FrameKind

MALFORMED_FRAMES = Counter(
    "specmesh_detokenizer_malformed_frames_total", "Frames that could not be decoded", ["reason"]
)
UNKNOWN_REQUEST_FRAMES = Counter(
    "specmesh_detokenizer_unknown_request_frames_total", "Frame records for request ids never opened here"
)
BAD_MESSAGES = Counter(
    "specmesh_detokenizer_bad_messages_total", "DetokOpen or Cancel messages that failed validation", ["subject"]
)

FRAMES = Counter("specmesh_detokenizer_frames", "Frames decoded, by kind", ["kind"])
TOKENS = Counter("specmesh_detokenizer_tokens", "Emitted tokens processed (from TARGET records)")
CHUNKS = Counter("specmesh_detokenizer_chunks", "Chunks sent to gateways")
ACTIVE = Gauge("specmesh_detokenizer_active_requests", "Requests opened and not yet finished")
REAPED = Counter(
    "specmesh_detokenizer_reaped_requests", "Open requests closed after no frame for --idle-request-timeout"
)
ABANDONED = Counter(
    "specmesh_detokenizer_abandoned_requests",
    "Open requests closed and stopped because their gateway is gone or no longer waits for them",
)
LAG = Histogram(
    "specmesh_detokenizer_step_to_chunk_lag_seconds",
    "From the end of a worker step (frame header) to its chunks leaving the detokenizer, once per TARGET frame",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
)
FRAMES_BY_KIND = {kind: FRAMES.labels(kind=kind.name.lower()) for kind in FrameKind}
