"""Predicted outputs: where the output stands in the prediction and what is drafted from it, how much of a
prediction an answer used (usage.completion_tokens_details), and in the engine, under every kind of proposer, a
prediction (edited or not) that saves steps without changing a token, greedy or seeded."""

from __future__ import annotations

import pytest

from shared.prediction import PredictionCursor, prediction_usage
from shared.schemas import SpeculationParams
from tests.methodfixture import (  # noqa: F401  (fixtures are used by name)
    GREEDY, METHODS, greedy_reference, make_engine, make_request, model_dirs, mtp_model_dir, mtp_model_dirs,
    outputs_of, prompts, reference_model, run, tiny_model_dir, tokens_of,
)

NUM_TOKENS = 40
EDITED = slice(12, 15)  # tokens of the prediction the answer will not follow

PREDICTION = [10, 11, 12, 13, 14, 15, 16, 17]


def _drafts(prediction: list[int], answers: list[list[int]], num_drafts: int = 3) -> list[list[int]]:
    """The drafts of one cursor as the answer grows through `answers` (each the answer so far)."""
    cursor = PredictionCursor(prediction, 5)
    drafts = []
    for answer in answers:
        cursor.advance(answer)
        drafts.append(cursor.next_tokens(num_drafts))
    return drafts


def test_drafts_follow_where_the_answer_stands_in_the_prediction() -> None:
    assert _drafts(PREDICTION, [[], [10, 11, 12], [10, 11, 12, 13, 14, 15, 16], PREDICTION]) == [
        [10, 11, 12], [13, 14, 15], [17], [],  # the prediction's start, then on; it ends
    ]


def test_after_an_edit_the_answer_meets_the_prediction_again() -> None:
    edited = [10, 11, 99, 98]  # the answer leaves the prediction: nothing places its end there
    assert _drafts(PREDICTION, [[10, 11], edited, [*edited, 13, 14]]) == [[12, 13, 14], [], [15, 16, 17]]


def test_a_repeated_passage_is_followed_where_the_answer_is_not_where_it_recurs() -> None:
    looping = [1, 2, 3, 1, 2, 3, 1, 2, 3, 4]
    assert _drafts(looping, [[1, 2, 3], [1, 2, 3, 1, 2, 3]]) == [[1, 2, 3], [1, 2, 3]]
    # Rejoining after an edit, the first occurrence from where the answer left the prediction on.
    assert _drafts(looping, [[1, 2, 3, 1], [1, 2, 3, 1, 9, 2, 3]]) == [[2, 3, 1], [1, 2, 3]]


def test_a_resumed_answer_is_placed_in_its_prediction_from_its_tokens() -> None:
    assert _drafts(PREDICTION, [[10, 11, 12, 13]]) == [[14, 15, 16]]
    assert _drafts(PREDICTION, [[7, 13, 14]]) == [[15, 16, 17]]


def test_no_prediction_or_no_budget_drafts_nothing() -> None:
    assert _drafts([], [[1, 2]]) == [[]]
    assert _drafts(PREDICTION, [[]], num_drafts=0) == [[]]


def test_usage_counts_the_prediction_tokens_the_answer_used_and_the_rest() -> None:
    assert prediction_usage(PREDICTION, PREDICTION).model_dump() == {
        "accepted_prediction_tokens": 8, "rejected_prediction_tokens": 0,
    }
    edited = [10, 11, 99, 13, 14, 15, 16, 17, 5]  # 12 replaced, 5 appended
    assert prediction_usage(PREDICTION, edited).model_dump() == {
        "accepted_prediction_tokens": 7, "rejected_prediction_tokens": 1,
    }
    assert prediction_usage(PREDICTION, []).rejected_prediction_tokens == 8


def _edited(tokens: list[int]) -> tuple[int, ...]:
    edited = list(tokens)
    edited[EDITED] = [(t + 1) % 100 for t in edited[EDITED]]
    return tuple(edited)


def _predicted(prompt: list[int], prediction: tuple[int, ...], **sampling):
    speculative = SpeculationParams(prediction_token_ids=prediction, return_stats=True)
    return make_request(prompt, max_tokens=NUM_TOKENS, speculative=speculative, **sampling)


@pytest.mark.parametrize("name", ["ngram", "mtp"])  # a point-mass and a model drafter
def test_a_prediction_saves_steps_and_changes_no_greedy_token(model_dirs, prompts, greedy_reference, name) -> None:
    pytest.importorskip("transformers")
    method = METHODS[name]
    expected = greedy_reference(prompts[0], NUM_TOKENS)
    engine = make_engine(model_dirs(method), method)
    plain = make_request(prompts[0], max_tokens=NUM_TOKENS, **GREEDY)
    exact = _predicted(prompts[0], tuple(expected), **GREEDY)
    edited = _predicted(prompts[0], _edited(expected), **GREEDY)
    steps = run(engine, {0: [plain, exact, edited]})
    assert tokens_of(steps, plain) == tokens_of(steps, exact) == tokens_of(steps, edited) == expected
    num_steps = [len(outputs_of(steps, r)) for r in (plain, exact, edited)]
    # Each decode step of an exact prediction accepts every draft; the first token comes with the prefill.
    assert num_steps[1] <= 1 + -(-(NUM_TOKENS - 1) // (1 + method.num_speculative_tokens)) < num_steps[0]
    assert num_steps[1] <= num_steps[2] < num_steps[0]  # an edit costs a few steps, then the prediction pays again


def test_a_seeded_sampled_answer_is_the_same_with_a_prediction(tiny_model_dir, prompts) -> None:  # noqa: F811
    method = METHODS["ngram"]
    engine = make_engine(tiny_model_dir, method)
    sampling = dict(temperature=1.0, seed=7, ignore_eos=True)
    plain = make_request(prompts[1], max_tokens=NUM_TOKENS, **sampling)
    answer = tokens_of(run(engine, {0: [plain]}), plain)
    predicted = _predicted(prompts[1], _edited(answer), **sampling)
    steps = run(engine, {0: [predicted]})
    assert tokens_of(steps, predicted) == answer
    assert any(o.num_accepted for o in outputs_of(steps, predicted))


def test_a_repetitive_prediction_counts_each_answer_token_once() -> None:
    """A prediction of one phrase repeated offers every answer token many places: each counts once."""
    prediction, answer = [1, 2, 3] * 50, [1, 2, 7] * 40
    usage = prediction_usage(prediction, answer)
    assert usage.accepted_prediction_tokens <= len(answer)
    assert usage.accepted_prediction_tokens + usage.rejected_prediction_tokens == len(prediction)
    assert _drafts(prediction, [[1, 2, 3] * 20]) == [[1, 2, 3]]  # it follows the repeats in order
