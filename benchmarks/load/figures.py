"""The figures of a load run, from the generator's records: errors, requests, time to first token, inter-token
latency, outputs that differ between equal requests, and, around a kill, the longest stall a stream saw."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass

from benchmarks.load.plan import CLEAR_ERRORS, LEFT, STREAM, Record

MS = 1000.0
PERCENTILES = (50, 99)
MAX_ERRORS_SHOWN = 10


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile by linear interpolation between closest ranks (numpy's default), None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _ms(values: list[float]) -> dict[str, float | None]:
    return {f"p{q}": None if (p := percentile(values, q)) is None else round(p * MS, 2) for q in PERCENTILES}


def gaps(record: Record) -> list[tuple[float, float]]:
    """(gap, when it ended) for each wait of a stream: sending to the first chunk, chunk to chunk, and the last
    chunk to the end; `when` in the monotonic clock."""
    marks = [0.0, *record.arrivals] + ([record.ended] if record.ended is not None else [])
    return [(b - a, record.sent + b) for a, b in zip(marks, marks[1:])]


@dataclass
class LoadFigures:
    requests: int  # streams that ran to their end or failed (leaving clients not counted)
    errors: int
    errors_by_kind: dict[str, int]  # plan.py: REFUSED, ERROR_EVENT, BROKEN, WRONG_LENGTH
    error_samples: list[str]
    tokens: int
    tokens_per_s: float
    ttft_ms: dict[str, float | None]
    itl_ms: dict[str, float | None]  # gaps between chunks with text; a chunk of several tokens is one gap
    divergent_outputs: int  # equal requests (prompt, greedy or seed) whose texts differ
    disconnects: int  # leaving clients that left before their stream ended
    disconnects_by_phase: dict[str, int]  # when they left: before the response, before the first token, mid-stream
    disconnects_finished_first: int  # leaving clients whose stream ended before they left
    disconnect_errors: int  # leaving clients that got an error before they left

    @property
    def unclear_errors(self) -> int:
        """Failures the mesh did not explain: broken or stalled streams, wrong lengths."""
        return sum(count for kind, count in self.errors_by_kind.items() if kind not in CLEAR_ERRORS)

    def to_json(self) -> dict:
        return asdict(self)


def _phase(record: Record) -> str:
    if record.status is None:
        return "before_response"
    return "mid_stream" if record.arrivals else "before_first_token"


def load_figures(records: list[Record], wall_s: float) -> LoadFigures:
    streams = [r for r in records if r.kind == STREAM]
    failed = [r for r in streams if r.error]
    served = [r for r in streams if not r.error]
    ttft = [r.arrivals[0] for r in served if r.arrivals]
    itl = [b - a for r in served for a, b in zip(r.arrivals, r.arrivals[1:])]
    outputs: dict[tuple[int, int | None], set[str]] = defaultdict(set)
    for r in served:
        outputs[(r.prompt, r.seed)].add(r.text_digest)
    left = [r for r in records if r.kind == LEFT]
    tokens = sum(r.tokens or 0 for r in served)
    gone = [r for r in left if not r.finished and not r.error]
    return LoadFigures(
        requests=len(streams),
        errors=len(failed),
        errors_by_kind=dict(Counter(r.error_kind for r in failed)),
        error_samples=sorted({r.error for r in failed})[:MAX_ERRORS_SHOWN],
        tokens=tokens,
        tokens_per_s=round(tokens / wall_s, 1) if wall_s > 0 else 0.0,
        ttft_ms=_ms(ttft),
        itl_ms=_ms(itl),
        divergent_outputs=sum(len(texts) - 1 for texts in outputs.values()),
        disconnects=len(gone),
        disconnects_by_phase=dict(Counter(_phase(r) for r in gone)),
        disconnects_finished_first=sum(1 for r in left if r.finished),
        disconnect_errors=sum(1 for r in left if r.error),
    )


@dataclass
class StallFigures:
    """What a kill cost the streams: the longest wait of any stream that ended after the kill (its first token
    included), beside the longest before it, and whether the streams in flight at the kill were all served."""

    killed: str
    at_s: float  # seconds after the load started
    stall_s: float | None
    longest_gap_before_s: float | None
    in_flight_at_kill: int
    in_flight_served: int
    started_after: int
    started_after_served: int

    def to_json(self) -> dict:
        return asdict(self)


def stall_figures(records: list[Record], killed: str, killed_at: float, load_started: float) -> StallFigures:
    streams = [r for r in records if r.kind == STREAM]
    after = [gap for r in streams for gap, end in gaps(r) if end >= killed_at]
    before = [gap for r in streams for gap, end in gaps(r) if end < killed_at]
    spanning = [r for r in streams if r.sent <= killed_at <= r.sent + (r.ended or 0.0)]
    later = [r for r in streams if r.sent > killed_at]
    return StallFigures(
        killed=killed,
        at_s=round(killed_at - load_started, 2),
        stall_s=round(max(after), 3) if after else None,
        longest_gap_before_s=round(max(before), 3) if before else None,
        in_flight_at_kill=len(spanning),
        in_flight_served=sum(1 for r in spanning if not r.error),
        started_after=len(later),
        started_after_served=sum(1 for r in later if not r.error),
    )
