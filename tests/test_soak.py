"""The soak harness (benchmarks/soak.py) in quick runs: the whole mesh as processes, loaded by locust.

A few seconds of concurrent streams with a few dozen clients leaving mid-stream must give no error, equal outputs
for equal requests, and every service's gauges back at zero. The long runs (32 streams for 10 minutes, 1,000
disconnects, kills under load) are commands in README.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.load.figures import StallFigures, gaps, percentile, stall_figures
from benchmarks.load.plan import ERROR_EVENT, GREEDY_SEED, STREAM, Record
from benchmarks.soak import parse_args, run_soak, summary

QUICK_STREAMS = 4
QUICK_DURATION_S = 5
QUICK_DISCONNECTS = 30


# No `exclusive` mark: it checks outcomes (errors, equal outputs, disconnects made, gauges back at zero), none
# bounded by a time the other worker's tests could stretch; it passes beside three busy processes on 2 cores.
@pytest.mark.e2e
def test_quick_soak_with_disconnects_leaves_no_error_and_nothing_held(tmp_path: Path) -> None:
    args = parse_args([
        "--streams", str(QUICK_STREAMS), "--duration", str(QUICK_DURATION_S), "--max-tokens", "32", "--prompts", "3",
        "--disconnects", str(QUICK_DISCONNECTS), "--leavers", "4", "--disconnect-max-delay", "0.5",
        "--out", str(tmp_path),
    ])
    report = run_soak(args)
    assert report["ok"], summary(report)
    load = report["load"]
    assert load["requests"] >= QUICK_STREAMS and load["errors"] == 0
    assert load["disconnects"] == QUICK_DISCONNECTS
    assert report["idle_after_load"]["all_zero"], report["idle_after_load"]
    assert load["ttft_ms"]["p50"] is not None and load["itl_ms"]["p99"] is not None
    assert {"gateway", "worker-0", "detokenizer", "nats", "up"} <= report["memory_mib"].keys()
    assert report["tracebacks"] == 0


def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)


def _stream(sent: float, arrivals: list[float], ended: float, error: str | None = None) -> Record:
    record = Record(STREAM, 0, GREEDY_SEED, sent, arrivals, ended)
    if error:
        record.fail(ERROR_EVENT, error)
    return record


def test_gaps_count_the_wait_for_the_first_chunk_and_for_the_end() -> None:
    rounded = [(round(gap, 6), round(end, 6)) for gap, end in gaps(_stream(10.0, [0.5, 0.6], 1.0))]
    assert rounded == [(0.5, 10.5), (0.1, 10.6), (0.4, 11.0)]


def test_stall_is_the_longest_wait_ending_after_the_kill() -> None:
    records = [
        _stream(0.0, [0.1, 0.2, 3.2], 3.3),  # in flight at the kill (t=1): waited 3.0 s, then served
        _stream(0.5, [0.6], 0.7, error="the detokenizer is gone"),  # in flight, failed
        _stream(2.0, [2.5], 2.6),  # started after the kill
    ]
    stall = stall_figures(records, "worker-0", killed_at=1.0, load_started=0.0)
    assert stall == StallFigures(
        killed="worker-0", at_s=1.0, stall_s=3.0, longest_gap_before_s=0.1, in_flight_at_kill=2,
        in_flight_served=1, started_after=1, started_after_served=1,
    )
