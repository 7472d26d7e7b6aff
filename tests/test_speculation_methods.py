"""Every drafting method (naive, ngram, suffix, mtp, mtp+with_ngram) in the engine: greedy output equals
transformers' greedy generation alone and inside a batch of greedy and sampled rows, every verify strategy runs
with every method, and drafts do get accepted (the comparisons are not vacuous)."""

from __future__ import annotations

import pytest

from services.worker.engine.engine import Engine, SeqOutput
from services.worker.sampling.rejection import VERIFY_STRATEGIES
from tests.methodfixture import (  # noqa: F401  (fixtures are used by name)
    DRAFTING_METHOD_NAMES, GREEDY, METHOD_NAMES, METHODS, Steps, greedy_reference, make_engine, make_request,
    model_dirs, mtp_model_dir, mtp_model_dirs, outputs_of, prompts, reference_model, run, single_thread,
    tiny_model_dir, tokens_of,
)

pytest.importorskip("transformers")

ALONE_TOKENS = 40
# The tiny random model's next-token distribution is nearly flat (top p ~ 1.6 / vocab, near ties common); at
# this temperature a sampled row follows the greedy text, whose drafts every method gets accepted, so the
# sampled path of every strategy accepts drafts too.
LOW_TEMPERATURE = 0.001


def _check_steps(steps: Steps, engine: Engine) -> None:
    """Per-step invariants of speculation: accepted drafts lead the emitted tokens, at most one more follows."""
    for out in (o for outputs in steps for o in outputs):
        assert 0 <= out.num_accepted <= len(out.draft_tokens) <= engine.config.speculative.num_drafts
        assert out.tokens[: out.num_accepted] == out.draft_tokens[: out.num_accepted]
        assert out.num_accepted <= len(out.tokens) <= out.num_accepted + 1
        assert all(0 <= t < engine.runner.model.config.vocab_size for t in out.tokens)


def _accepted(outs: list[SeqOutput]) -> int:
    return sum(o.num_accepted for o in outs)


@pytest.mark.parametrize("name", METHOD_NAMES)
def test_greedy_alone_matches_transformers(model_dirs, prompts, greedy_reference, name) -> None:
    method = METHODS[name]
    engine = make_engine(model_dirs(method), method)
    request = make_request(prompts[0], max_tokens=ALONE_TOKENS, **GREEDY)
    steps = run(engine, {0: [request]})
    assert tokens_of(steps, request) == greedy_reference(prompts[0], ALONE_TOKENS)
    _check_steps(steps, engine)
    if method.drafts:
        assert engine.stats.num_accepted_tokens > 0
        assert len(steps) < ALONE_TOKENS  # accepted drafts saved steps
    else:
        assert engine.stats.num_draft_tokens == 0 and len(steps) == ALONE_TOKENS


@pytest.mark.parametrize("name", METHOD_NAMES)
def test_greedy_rows_of_a_mixed_batch_match_transformers(model_dirs, prompts, greedy_reference, name) -> None:
    method = METHODS[name]
    greedy = [
        make_request(prompts[0], max_tokens=24, **GREEDY),
        make_request(prompts[2], max_tokens=30, logprobs=3, include_draft_logprobs=True, **GREEDY),
        make_request(prompts[3], max_tokens=12, **GREEDY),
        make_request(prompts[1], max_tokens=20, **GREEDY),  # joins late and waits for a slot
    ]
    sampled = [
        make_request(prompts[1], max_tokens=16, temperature=0.8, seed=11, ignore_eos=True),
        make_request(prompts[2], max_tokens=20, temperature=1.0, top_k=50, top_p=0.9, seed=5, ignore_eos=True),
    ]
    engine = make_engine(model_dirs(method), method)
    steps = run(engine, {0: [greedy[0], sampled[0], greedy[1], greedy[2]], 3: [sampled[1], greedy[3]]})
    for request in greedy:
        expected = greedy_reference(list(request.prompt_token_ids), request.sampling.max_tokens)
        assert tokens_of(steps, request) == expected
    for request in sampled:
        assert len(tokens_of(steps, request)) == request.sampling.max_tokens
    _check_steps(steps, engine)
    if method.drafts:
        assert all(_accepted(outputs_of(steps, r)) > 0 for r in greedy[:2])


@pytest.mark.parametrize("strategy", VERIFY_STRATEGIES)
@pytest.mark.parametrize("name", DRAFTING_METHOD_NAMES)
def test_every_verify_strategy_runs_with_every_method(model_dirs, prompts, greedy_reference, name, strategy) -> None:
    """Greedy rows follow the greedy rule under every strategy, so they still equal transformers; sampled rows
    (with top-p for the topp strategy) run to their length and have drafts accepted."""
    method = METHODS[name]
    greedy = make_request(prompts[0], max_tokens=20, **GREEDY)
    sampled = [
        make_request(prompts[0], max_tokens=20, temperature=LOW_TEMPERATURE, seed=3, ignore_eos=True),
        make_request(prompts[3], max_tokens=20, temperature=1.0, top_p=0.9, seed=4, ignore_eos=True),
    ]
    engine = make_engine(model_dirs(method), method, verify_strategy=strategy)
    steps = run(engine, {0: [greedy, *sampled]})
    assert tokens_of(steps, greedy) == greedy_reference(prompts[0], 20)
    assert all(len(tokens_of(steps, r)) == 20 for r in sampled)
    _check_steps(steps, engine)
    assert _accepted(outputs_of(steps, greedy)) > 0
    assert sum(_accepted(outputs_of(steps, r)) for r in sampled) > 0
