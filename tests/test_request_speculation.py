"""Speculation per request in the engine and at the detokenizer: a request's own num_speculative_tokens caps its
drafts per step (0 turns speculation off for it) without changing its greedy output, a request that asks for its
summary gets a DRAFT record for every step that drafted, and the detokenizer's tally turns those into
usage.speculative."""

from __future__ import annotations

import pytest

from services.detokenizer.speculation import SpeculationTally
from shared.schemas import SpeculationParams
from tests.methodfixture import (  # noqa: F401  (fixtures are used by name)
    GREEDY, METHODS, greedy_reference, make_engine, make_request, model_dirs, mtp_model_dir, mtp_model_dirs,
    outputs_of, prompts, reference_model, run, single_thread, tiny_model_dir, tokens_of,
)

pytest.importorskip("transformers")

NUM_TOKENS = 30
SERVER_DRAFTS = 3
LOOP_TOKENS = 39


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
@pytest.mark.parametrize("name", ["ngram", "mtp"])
def test_each_request_drafts_at_most_its_own_number(model_dirs, prompts, greedy_reference, name, adaptive) -> None:
    method = METHODS[name]
    # A prompt ending inside the loop its greedy continuation repeats, so that prompt lookup drafts several tokens.
    prompt = prompts[1] + greedy_reference(prompts[1], LOOP_TOKENS)
    caps = [None, 2, 1, 0]
    requests = [
        make_request(prompt, max_tokens=NUM_TOKENS, speculative=SpeculationParams(num_speculative_tokens=cap),
                     **GREEDY)
        for cap in caps
    ]
    engine = make_engine(
        model_dirs(method), method, num_speculative_tokens=SERVER_DRAFTS, adaptive=adaptive,
        **({"num_model_steps": SERVER_DRAFTS} if method.needs_mtp else {}),
    )
    steps = run(engine, {0: requests})
    expected = greedy_reference(prompt, NUM_TOKENS)
    for cap, request in zip(caps, requests):
        outs = outputs_of(steps, request)
        assert tokens_of(steps, request) == expected
        assert max(len(o.draft_tokens) for o in outs) <= (SERVER_DRAFTS if cap is None else cap)
    drafted = [max(len(o.draft_tokens) for o in outputs_of(steps, r)) for r in requests]
    assert drafted[-1] == 0
    if not adaptive:  # the adaptive gate follows measured step times, so how much it drafts is not fixed
        assert drafted[-2] == 1 and drafted[0] > 1  # the caps bind, and speculation went on


def test_a_request_asking_for_its_summary_gets_a_draft_record_for_every_step_that_drafted(
    tiny_model_dir, prompts  # noqa: F811
) -> None:
    method = METHODS["ngram"]
    summary = make_request(prompts[0], max_tokens=NUM_TOKENS, speculative=SpeculationParams(return_stats=True),
                           **GREEDY)
    plain = make_request(prompts[0], max_tokens=NUM_TOKENS, **GREEDY)
    steps = run(make_engine(tiny_model_dir, method), {0: [summary, plain]})
    outs = outputs_of(steps, summary)
    assert any(o.draft_tokens for o in outs) and any(o.num_accepted for o in outs)
    for out in outs:
        assert (out.draft is not None) == bool(out.draft_tokens)
        if out.draft is not None:
            assert out.draft.token_ids[:, 0].tolist() == out.draft_tokens  # the tokens, no logprobs computed
    assert all(o.draft is None for o in outputs_of(steps, plain))


def test_tally_counts_steps_positions_and_acceptance() -> None:
    tally = SpeculationTally()
    for drafted, accepted in [(3, 3), (3, 1), (2, 0), (0, 0), (1, 1)]:
        tally.observe(drafted, accepted)
    usage = tally.usage()
    assert (usage.num_spec_steps, usage.num_draft_tokens, usage.num_accepted_draft_tokens) == (4, 9, 5)
    assert usage.mean_acceptance_length == pytest.approx(1 + 5 / 4)
    assert usage.draft_acceptance_rate == pytest.approx(5 / 9)
    assert usage.num_draft_tokens_per_position == (4, 3, 2)
    assert usage.num_accepted_tokens_per_position == (3, 1, 1)
    assert usage.acceptance_rate_per_position == pytest.approx((3 / 4, 1 / 3, 1 / 2))
    assert usage.acceptance_histogram == (1, 2, 0, 1)
    other = SpeculationTally()
    other.observe(4, 2)
    merged = SpeculationTally.merged([tally, other]).usage()
    assert merged.num_draft_tokens_per_position == (5, 4, 3, 1)
    assert merged.acceptance_histogram == (1, 2, 1, 1, 0)
    empty = SpeculationTally().usage()
    assert (empty.num_spec_steps, empty.mean_acceptance_length, empty.draft_acceptance_rate) == (0, 1.0, 0.0)
    with pytest.raises(ValueError):
        tally.observe(1, 2)
