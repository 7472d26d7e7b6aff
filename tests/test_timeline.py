"""A sequence's phases on a worker (services/worker/engine/timeline.py): queue until its first cache slot, prefill
until its first token, decode until its end; a preemption or a later token moves none of the marks (what a worker
counts, and when: tests/test_worker_finishes.py)."""

from __future__ import annotations

from services.worker.engine.timeline import Timeline


def test_phases_split_the_time_at_the_first_slot_and_the_first_token() -> None:
    timeline = Timeline(arrived=10.0)
    timeline.scheduled, timeline.first_token = 10.5, 12.0
    timeline.on_scheduled()  # a preempted sequence admitted again keeps its first slot
    timeline.on_token()
    assert (timeline.scheduled, timeline.first_token) == (10.5, 12.0)
    assert timeline.phases(finished=15.0) == (0.5, 1.5, 3.0)


def test_a_sequence_that_ends_before_a_mark_spends_nothing_after_it() -> None:
    """One refused or ended in its prefill (a stop at once) has no decode; one never scheduled, only a queue."""
    timeline = Timeline(arrived=1.0)
    assert timeline.phases(finished=4.0) == (3.0, 0.0, 0.0)
    timeline.on_scheduled()
    timeline.on_token()
    queue, prefill, decode = timeline.phases(finished=timeline.first_token)
    assert queue >= 0 and prefill >= 0 and decode == 0
