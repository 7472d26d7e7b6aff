"""Continuous-batching bookkeeping without a model: admission, slots, aborts, and when a sequence stops."""

from __future__ import annotations

import pytest

from services.worker.engine.scheduler import Scheduler
from services.worker.engine.sequence import SeqState, Sequence
from shared.frames import FinishReason
from shared.schemas import SamplingParams

MAX_MODEL_LEN = 32
STOP_ID = 7
SEED = 1234


def _seq(name: str, prompt_len: int = 4, max_tokens: int = 16, stop_ids: frozenset[int] = frozenset()) -> Sequence:
    request_id = name.encode().hex().ljust(32, "0")
    prompt = list(range(100, 100 + prompt_len))
    return Sequence(request_id, prompt, SamplingParams(max_tokens=max_tokens), SEED, stop_ids)


def _finish(seq: Sequence) -> None:
    seq.append([1] * seq.max_new_tokens(MAX_MODEL_LEN), MAX_MODEL_LEN)
    assert seq.is_finished


def test_admission_stops_at_max_num_seqs_first_come_first_served() -> None:
    scheduler = Scheduler(max_num_seqs=2)
    seqs = [_seq(f"s{i}") for i in range(4)]
    for seq in seqs:
        scheduler.add(seq)
    admitted = scheduler.admit()
    assert admitted == seqs[:2]
    assert scheduler.running == seqs[:2]
    assert list(scheduler.waiting) == seqs[2:]
    assert {s.slot for s in admitted} == {0, 1}
    assert all(s.state is SeqState.RUNNING for s in admitted)
    assert all(s.state is SeqState.WAITING and s.slot is None for s in seqs[2:])
    assert scheduler.admit() == []  # no free slot: nothing moves
    assert scheduler.num_unfinished == 4


def test_finished_sequence_frees_its_slot_for_the_next_waiting_one() -> None:
    scheduler = Scheduler(max_num_seqs=2)
    first, second, third = _seq("a"), _seq("b"), _seq("c")
    for seq in (first, second, third):
        scheduler.add(seq)
    scheduler.admit()
    freed = first.slot
    _finish(first)
    assert scheduler.release_finished() == [first]
    assert first.slot is None
    assert scheduler.running == [second]
    assert scheduler.admit() == [third]
    assert third.slot == freed
    assert second.slot != third.slot
    assert scheduler.release_finished() == []


def test_slots_stay_distinct_through_many_arrivals_and_departures() -> None:
    scheduler = Scheduler(max_num_seqs=3)
    for i in range(10):
        scheduler.add(_seq(f"r{i}"))
    for _ in range(10):
        scheduler.admit()
        slots = [s.slot for s in scheduler.running]
        assert len(set(slots)) == len(slots) and all(0 <= s < 3 for s in slots)
        _finish(scheduler.running[0])
        scheduler.release_finished()
    assert scheduler.num_unfinished == 0


def _one_running_one_waiting() -> tuple[Scheduler, Sequence, Sequence]:
    """A one-slot scheduler running one sequence while another waits."""
    scheduler = Scheduler(max_num_seqs=1)
    running, waiting = _seq("a"), _seq("b")
    scheduler.add(running)
    scheduler.add(waiting)
    scheduler.admit()
    return scheduler, running, waiting


def test_abort_of_a_waiting_sequence_removes_it_from_the_queue() -> None:
    scheduler, running, waiting = _one_running_one_waiting()
    assert scheduler.abort(waiting.request_id) == [waiting]
    assert waiting.is_finished and waiting.finish_reason is FinishReason.ABORT
    assert list(scheduler.waiting) == []
    assert scheduler.running == [running]
    assert scheduler.num_unfinished == 1


def test_abort_of_a_running_sequence_frees_its_slot_at_release() -> None:
    scheduler, running, waiting = _one_running_one_waiting()
    slot = running.slot
    assert scheduler.abort(running.request_id) == [running]
    assert running.is_finished and running.finish_reason is FinishReason.ABORT
    assert scheduler.release_finished() == [running]
    assert scheduler.admit() == [waiting]
    assert waiting.slot == slot


def test_abort_of_an_unknown_request_returns_nothing() -> None:
    scheduler = Scheduler(max_num_seqs=1)
    scheduler.add(_seq("a"))
    assert scheduler.abort("f" * 32) == []
    assert scheduler.num_unfinished == 1


def test_stop_id_ends_the_sequence_and_is_kept_last() -> None:
    seq = _seq("a", stop_ids=frozenset({STOP_ID}))
    kept = seq.append([1, 2, STOP_ID, 3, 4], MAX_MODEL_LEN)
    assert kept == [1, 2, STOP_ID]
    assert seq.output_ids == [1, 2, STOP_ID]
    assert seq.is_finished and seq.finish_reason is FinishReason.STOP


def test_max_tokens_ends_the_sequence_with_length() -> None:
    seq = _seq("a", max_tokens=3)
    assert seq.append([1, 2], MAX_MODEL_LEN) == [1, 2]
    assert not seq.is_finished and seq.finish_reason is FinishReason.NONE
    assert seq.append([3, 4, 5], MAX_MODEL_LEN) == [3]
    assert seq.output_ids == [1, 2, 3]
    assert seq.finish_reason is FinishReason.LENGTH


def test_stop_id_wins_over_length_on_the_last_allowed_token() -> None:
    seq = _seq("a", max_tokens=2, stop_ids=frozenset({STOP_ID}))
    assert seq.append([1, STOP_ID], MAX_MODEL_LEN) == [1, STOP_ID]
    assert seq.finish_reason is FinishReason.STOP


def test_context_length_ends_the_sequence_with_length() -> None:
    seq = _seq("a", prompt_len=MAX_MODEL_LEN - 2, max_tokens=100)
    assert seq.append([1, 2, 3], MAX_MODEL_LEN) == [1, 2]
    assert seq.num_tokens == MAX_MODEL_LEN
    assert seq.finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize(
    "prompt_len,max_tokens,emitted,expected",
    [
        (4, 10, 0, 10),  # max_tokens binds
        (4, 10, 3, 7),
        (MAX_MODEL_LEN - 5, 10, 0, 5),  # the context binds
        (MAX_MODEL_LEN - 5, 10, 2, 3),
    ],
)
def test_max_new_tokens_is_the_tighter_of_max_tokens_and_context(
    prompt_len: int, max_tokens: int, emitted: int, expected: int
) -> None:
    seq = _seq("a", prompt_len=prompt_len, max_tokens=max_tokens)
    seq.append([1] * emitted, MAX_MODEL_LEN)
    assert seq.max_new_tokens(MAX_MODEL_LEN) == expected


def test_tokens_already_streamed_count_towards_max_tokens() -> None:
    seq = Sequence("0" * 32, [1, 2, 3], SamplingParams(max_tokens=4), SEED, frozenset(), output_ids=[5, 6, 7])
    assert seq.token_ids == [1, 2, 3, 5, 6, 7]
    assert seq.max_new_tokens(MAX_MODEL_LEN) == 1
    assert seq.append([8, 9], MAX_MODEL_LEN) == [8]
    assert seq.finish_reason is FinishReason.LENGTH


def _choices(name: str, n: int) -> list[Sequence]:
    """n choices of one request, as the engine queues them."""
    seqs = [_seq(name) for _ in range(n)]
    for choice, seq in enumerate(seqs):
        seq.choice = choice
    return seqs


def _prefilled(seq: Sequence) -> None:
    """The sequence's prompt is computed and its first token sampled, as a prefill pass leaves it."""
    seq.num_computed = seq.prefill_target
    seq.append([1], MAX_MODEL_LEN)


def test_a_prefill_worker_decodes_the_choices_it_holds_only_when_their_siblings_cannot_come_in() -> None:
    scheduler = Scheduler(max_num_seqs=2, decode=False)
    choices = _choices("n3", 3)
    for seq in choices:
        scheduler.add(seq)
    plan = scheduler.schedule()
    assert plan.prefills == choices[:2] and plan.decodes == []
    for seq in choices[:2]:
        _prefilled(seq)
    # No slot for the third choice and nothing to prefill: the two it holds decode, or they would wait for ever.
    assert scheduler.schedule().decodes == choices[:2]
    _finish(choices[0])
    scheduler.release_finished()
    plan = scheduler.schedule()  # the third comes in: prefilling it, the worker decodes nothing
    assert plan.prefills == [choices[2]] and plan.decodes == []


def test_a_prefill_worker_does_not_decode_while_a_waiting_request_is_another_ones() -> None:
    scheduler = Scheduler(max_num_seqs=1, decode=False)
    held, other = _seq("held"), _seq("other")
    scheduler.add(held)
    scheduler.add(other)
    scheduler.schedule()
    _prefilled(held)
    assert scheduler.schedule().decodes == []  # held waits for no sibling: it is handed off, not decoded
