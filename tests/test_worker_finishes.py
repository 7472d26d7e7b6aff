"""What a worker counts as a finished sequence (services/worker/step_runner.py), with its phases
(engine/timeline.py) and token counts, through the real step runner on the demo model and the worker's metrics:
the engine's own finishes, and a stop string's end, which reaches the worker as the detokenizer's cancel."""

from __future__ import annotations

from prometheus_client import REGISTRY

from services.worker.engine_protocol import StepResult
from services.worker.metrics import WorkerMetrics
from services.worker.step_runner import StepRunner
from shared.config import DEFAULT_MODEL_DIR
from shared.schemas import Cancel, WorkRequest
from tests.methodfixture import METHODS, make_engine, make_request

PROMPT = [5, 6, 7, 8]
MODEL, METHOD = "finishes-test", "naive"


def _runner() -> StepRunner:
    return StepRunner(make_engine(DEFAULT_MODEL_DIR, METHODS[METHOD]), worker_id=1)


def _request(**sampling) -> WorkRequest:
    return make_request(PROMPT, temperature=0.0, **sampling).model_copy(update={"detok_id": "d"})


def _observed(result: StepResult, worker_id: int) -> dict[str, float | None]:
    """The worker's metrics once it observed the step: the stop finishes, decode times and step times counted."""
    labels = {"model": MODEL, "method": METHOD, "worker": str(worker_id)}
    WorkerMetrics(MODEL, METHOD, worker_id).observe_step(result.stats, result.seconds)
    return {
        "stop": REGISTRY.get_sample_value("specmesh_worker_finished_requests_total", labels | {"reason": "stop"}),
        "decode": REGISTRY.get_sample_value("specmesh_worker_request_decode_time_seconds_count", labels),
        "steps": REGISTRY.get_sample_value("specmesh_worker_step_duration_seconds_count", labels),
    }


def test_a_resumed_sequence_counts_only_the_tokens_this_worker_emits() -> None:
    """A request taken over with 5 tokens written elsewhere, run to 9 here: 4 of its generation tokens are this
    worker's, as its decode time is."""
    runner = _runner()
    result = runner.step([_request(output_token_ids=[9, 10, 11, 12, 13], max_tokens=9, ignore_eos=True)], [])
    while result.stats is None or not result.stats.finished_phases:
        result = runner.step([], [])
    [(queue, prefill, decode, num_prompt, num_output)] = result.stats.finished_phases
    assert (num_prompt, num_output) == (4, 4) and min(queue, prefill, decode) >= 0


def test_a_stop_strings_end_is_a_finish_with_its_phases_and_a_clients_cancel_is_not() -> None:
    """The detokenizer ends a request at a stop string with a cancel: the worker counts it finished ("stop", as the
    client is told) with its phases, in the step that releases it, whose batch is empty; a request the client left
    counts as neither."""
    runner = _runner()
    stopped, left = _request(max_tokens=50, ignore_eos=True), _request(max_tokens=50, ignore_eos=True)
    runner.step([stopped, left], [])
    for _ in range(3):
        runner.step([], [])
    result = runner.step([], [Cancel(request_id=left.request_id, reason="client_disconnected"),
                              Cancel(request_id=stopped.request_id, reason="stop_string")])
    assert result.stats.batch_size == 0  # nothing left to run: the step only releases the two
    assert result.stats.finished == {"stop": 1} and result.finished == [left.request_id, stopped.request_id]
    [(queue, prefill, decode, num_prompt, num_output)] = result.stats.finished_phases
    assert (num_prompt, num_output) == (4, 4) and min(queue, prefill, decode) >= 0 and decode > 0
    observed = _observed(result, 987)
    assert (observed["stop"], observed["decode"]) == (1, 1)


def test_a_stop_strings_end_of_a_waiting_request_counts_with_no_step() -> None:
    """A request admitted and ended by a stop string in one step (a handoff whose first token held it) leaves an idle
    engine at once: no step runs, and its finish is counted all the same, with no step time."""
    request = _request(max_tokens=50)
    result = _runner().step([request], [Cancel(request_id=request.request_id, reason="stop_string")])
    assert result.seconds is None and result.finished == [request.request_id]
    assert result.stats.finished == {"stop": 1} and result.stats.finished_phases[0][2:] == (0.0, 4, 0)
    observed = _observed(result, 988)
    assert observed["stop"] == 1 and observed["steps"] is None
