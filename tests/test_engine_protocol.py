"""The pipe messages between the worker's event loop and its engine process survive encode() and decode() whole."""

from __future__ import annotations

import dataclasses

import pytest

from services.worker.engine_protocol import (
    PICKLE_PROTO, EngineFailed, Gauges, StepResult, StepStats, Stop, Stopped, Unfinished, Work, decode, encode,
)
from services.worker.fail_reason import FailReason
from shared.schemas import Cancel, ChoiceProgress, SamplingParams

STATS = StepStats(
    batch_size=3, emitted=7, finished={"stop": 1, "length": 2}, drafted_at=[3, 2], accepted_at=[2, 1],
    acceptance_lengths=[3, 2, 1], finished_phases=[(0.01, 0.2, 1.5, 12, 40), (0.0, 0.1, 0.0, 3, 1)],
)


@pytest.mark.parametrize("result", [
    StepResult(
        step=12, frames=[("detok-a", b"\x01frame"), ("detok-b", b"")], finished=["r1"], gauges=Gauges(2, 1, 0.25),
        stats=STATS, seconds=0.004, num_preempted=1, failed=[("r2", FailReason.ENGINE_ERROR)],
        handoffs_recomputed=1, handoffs_imported=2, released=["r3"],
    ),
    StepResult(step=0, frames=[], finished=[], gauges=Gauges(0, 0, 0.0), stats=None, seconds=None),
], ids=["stepped", "refusals only"])
def test_step_result_round_trip(result: StepResult) -> None:
    back = decode(encode(result))
    assert back == result
    assert all(type(reason) is FailReason for _, reason in back.failed)


def test_step_result_goes_as_builtins() -> None:
    """Its wire form names no class (marshal, which encodes it, takes builtins only): encoding one is what the engine
    pays every step. It carries every field, so a field added to StepResult or StepStats must be added to to_wire and
    from_wire too."""
    result = StepResult(1, [("d", b"x")], [], Gauges(1, 0, 0.5), STATS, 0.002)
    wire = result.to_wire()
    assert b"StepResult" not in encode(result) and b"StepStats" not in encode(result)
    assert len(wire) == len(dataclasses.fields(StepResult))
    assert len(wire[4]) == len(dataclasses.fields(StepStats)) and len(wire[3]) == len(dataclasses.fields(Gauges))


def test_wire_formats_are_told_apart() -> None:
    """decode() reads a StepResult's marshal bytes and every other message's pickle by their first byte."""
    result = StepResult(3, [], [], Gauges(0, 0, 0.0), None, None)
    assert encode(result)[0] != PICKLE_PROTO
    assert all(encode(message)[0] == PICKLE_PROTO for message in (Stop(), Work(), EngineFailed("x")))


@pytest.mark.parametrize("message", [
    Work(new=[], cancels=[Cancel(request_id="a" * 32, reason="stop_string")]),
    Stop(),
    Stopped({"r": Unfinished((ChoiceProgress(index=0),), SamplingParams(seed=3))}, ["s"]),
    EngineFailed("Traceback ..."),
])
def test_other_messages_round_trip(message: object) -> None:
    assert decode(encode(message)) == message
