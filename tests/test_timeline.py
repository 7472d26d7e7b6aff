"""A sequence's phases on a worker (services/worker/engine/timeline.py): queue until its first cache slot, prefill
until its first token, decode until its end (the engine's, or a stop string's cancel); a preemption or a later token
moves none of the marks."""

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


def test_a_resumed_sequence_counts_only_the_tokens_this_worker_emits() -> None:
    """A request taken over with 5 tokens written elsewhere, run to 9 here: 4 of its generation tokens are this
    worker's, as its decode time is."""
    from services.worker.step_runner import StepRunner
    from shared.config import DEFAULT_MODEL_DIR
    from tests.methodfixture import METHODS, make_engine, make_request

    runner = StepRunner(make_engine(DEFAULT_MODEL_DIR, METHODS["naive"]), worker_id=1)
    request = make_request([5, 6, 7, 8], output_token_ids=[9, 10, 11, 12, 13], max_tokens=9, temperature=0.0,
                           ignore_eos=True)
    result = runner.step([request.model_copy(update={"detok_id": "d"})], [])
    while result.stats is None or not result.stats.finished_phases:
        result = runner.step([], [])
    [(queue, prefill, decode, num_prompt, num_output)] = result.stats.finished_phases
    assert (num_prompt, num_output) == (4, 4) and min(queue, prefill, decode) >= 0


def test_a_stop_strings_end_is_a_finish_with_its_phases_and_a_clients_cancel_is_not() -> None:
    """The detokenizer ends a request at a stop string with a cancel: the worker counts it finished ("stop", as the
    client is told) with its phases, in the step that releases it, whose batch is empty; a request the client left
    counts as neither."""
    from prometheus_client import REGISTRY

    from services.worker.metrics import WorkerMetrics
    from services.worker.step_runner import StepRunner
    from shared.config import DEFAULT_MODEL_DIR
    from shared.schemas import Cancel
    from tests.methodfixture import METHODS, make_engine, make_request

    runner = StepRunner(make_engine(DEFAULT_MODEL_DIR, METHODS["naive"]), worker_id=1)
    stopped, left = (make_request([5, 6, 7, 8], max_tokens=50, temperature=0.0, ignore_eos=True).model_copy(
        update={"detok_id": "d"}) for _ in range(2))
    runner.step([stopped, left], [])
    for _ in range(3):
        runner.step([], [])
    result = runner.step([], [Cancel(request_id=left.request_id, reason="client_disconnected"),
                              Cancel(request_id=stopped.request_id, reason="stop_string")])
    assert result.stats.batch_size == 0  # nothing left to run: the step only releases the two
    assert result.stats.finished == {"stop": 1} and result.finished == [left.request_id, stopped.request_id]
    [(queue, prefill, decode, num_prompt, num_output)] = result.stats.finished_phases
    assert (num_prompt, num_output) == (4, 4) and min(queue, prefill, decode) >= 0 and decode > 0
    labels = {"model": "timeline-test", "method": "naive", "worker": "987"}
    WorkerMetrics("timeline-test", "naive", 987).observe_step(result.stats, result.seconds)
    assert REGISTRY.get_sample_value("specmesh_worker_finished_requests_total", labels | {"reason": "stop"}) == 1
    assert REGISTRY.get_sample_value("specmesh_worker_request_decode_time_seconds_count", labels) == 1


def test_a_stop_strings_end_of_a_waiting_request_counts_with_no_step() -> None:
    """A request admitted and ended by a stop string in one step (a handoff whose first token held it) leaves an idle
    engine at once: no step runs, and its finish is counted all the same, with no step time."""
    from prometheus_client import REGISTRY

    from services.worker.metrics import WorkerMetrics
    from services.worker.step_runner import StepRunner
    from shared.config import DEFAULT_MODEL_DIR
    from shared.schemas import Cancel
    from tests.methodfixture import METHODS, make_engine, make_request

    runner = StepRunner(make_engine(DEFAULT_MODEL_DIR, METHODS["naive"]), worker_id=1)
    request = make_request([5, 6, 7, 8], max_tokens=50, temperature=0.0).model_copy(update={"detok_id": "d"})
    result = runner.step([request], [Cancel(request_id=request.request_id, reason="stop_string")])
    assert result.seconds is None and result.finished == [request.request_id]
    assert result.stats.finished == {"stop": 1} and result.stats.finished_phases[0][2:] == (0.0, 4, 0)
    labels = {"model": "timeline-test", "method": "naive", "worker": "988"}
    WorkerMetrics("timeline-test", "naive", 988).observe_step(result.stats, result.seconds)
    assert REGISTRY.get_sample_value("specmesh_worker_finished_requests_total", labels | {"reason": "stop"}) == 1
    assert REGISTRY.get_sample_value("specmesh_worker_step_duration_seconds_count", labels) is None
