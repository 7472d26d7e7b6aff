"""vLLM's thinking_token_budget in the worker (services/worker/sampling/thinking_budget.py): where a reasoning block
stands token by token, the closing tag forced once the block holds the budget, in the scored rows of every drafting
method (drafts before a row counted as output) so that greedy output is the step-by-step rule's and seeded output
does not depend on the batch. Tag ids here are arbitrary tokens of the tiny models' vocabulary: the worker matches
tokens, not text (the gateway finds the tags' ids, tests/test_e2e_reasoning_mistral.py)."""

from __future__ import annotations

import uuid

import pytest
import torch

from services.worker.engine.sequence import Sequence
from services.worker.sampling.penalties import MASKED, LogitPenalties, apply_penalties
from services.worker.sampling.thinking_budget import Phase, Scan, scan_output
from shared.schemas import SamplingParams, ThinkingBudget
from tests.methodfixture import (  # noqa: F401  (fixtures are used by name)
    METHOD_NAMES, METHODS, greedy_reference, make_engine, make_request, model_dirs, mtp_model_dir, mtp_model_dirs,
    prompts, reference_model, run, single_thread, tiny_model_dir, tokens_alone, tokens_of,
)

pytest.importorskip("transformers")

OPEN, CLOSE, LAYOUT = 8, 7, 9  # token ids standing for <think>, </think> and a line break
NUM_TOKENS = 12
BUDGET = 3


def _budget(starts_inside: bool, budget: int = BUDGET) -> ThinkingBudget:
    return ThinkingBudget(
        budget=budget, open_id=OPEN, close_id=CLOSE, starts_inside=starts_inside, layout_ids=(LAYOUT,)
    )


def test_the_scan_follows_the_block_token_by_token() -> None:
    may_open = _budget(starts_inside=False)
    start = Scan.start(may_open)
    assert start.advance(may_open, [LAYOUT, LAYOUT]).phase is Phase.BEFORE
    inside = start.advance(may_open, [LAYOUT, OPEN, 1, 2])
    assert (inside.phase, inside.thought, inside.forced(may_open)) == (Phase.INSIDE, 2, None)
    assert inside.advance(may_open, [3]).forced(may_open) == CLOSE
    assert inside.advance(may_open, [CLOSE, OPEN, 1, 2, 3]).phase is Phase.PAST  # one block, at the start
    assert start.advance(may_open, [1, OPEN, 2, 3, 4]).phase is Phase.PAST  # an answer without the block
    opened = Scan.start(_budget(starts_inside=True))
    assert opened.advance(may_open, [1, 2, 3]).forced(may_open) == CLOSE
    assert Scan.start(_budget(True, budget=0)).forced(_budget(True, budget=0)) == CLOSE
    kept = scan_output(may_open, [OPEN, 1], None)
    assert scan_output(may_open, [OPEN, 1, 2, 3], kept) == scan_output(may_open, [OPEN, 1, 2, 3], None)


def test_a_forced_row_keeps_only_the_closing_tag_whatever_else_masks_it() -> None:
    """Row j counts the drafts before it: the budget fills at the second draft, so rows 2 and 3 are forced; the
    allowed tokens leave the closing tag out, and the forced rows have it all the same."""
    vocab, width = 16, 4
    sampling = SamplingParams(max_tokens=64, thinking_budget=_budget(starts_inside=True), allowed_token_ids=(1, 2))
    seq = Sequence(uuid.uuid4().hex, [1], sampling, 0, frozenset(), output_ids=[1])
    logits = torch.randn(width, vocab, generator=torch.Generator().manual_seed(3))  # [width, V]
    got = apply_penalties(logits, LogitPenalties.build([seq], [[2, 2, 5]], width, vocab, logits.device))
    for j in range(width):
        finite = torch.nonzero(got[j] > MASKED).flatten().tolist()
        assert finite == ([CLOSE] if j >= 2 else [1, 2]), j
    assert seq.thinking_scan.scanned == 1  # the output's scan is kept; the drafts' are not


def _forced_reference(greedy_reference, prompt: list[int]) -> list[int]:
    """starts inside, the model never closing the block itself: BUDGET greedy tokens, the tag, then greedy on."""
    thought = greedy_reference(prompt, BUDGET)
    return thought + [CLOSE] + greedy_reference(prompt + thought + [CLOSE], NUM_TOKENS - BUDGET - 1)


@pytest.mark.parametrize("name", METHOD_NAMES)
def test_greedy_output_closes_the_block_at_the_budget(model_dirs, prompts, greedy_reference, name) -> None:
    method = METHODS[name]
    prompt = prompts[0]
    assert CLOSE not in greedy_reference(prompt, NUM_TOKENS)  # the model would think on
    request = make_request(prompt, max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True,
                           thinking_budget=_budget(starts_inside=True))
    assert tokens_alone(make_engine(model_dirs(method), method), request) == _forced_reference(greedy_reference,
                                                                                               prompt)


@pytest.mark.parametrize("name", METHOD_NAMES)
def test_an_answer_that_opens_the_block_is_held_to_the_budget_once(model_dirs, prompts, name) -> None:
    """logit_bias makes the model open the block, and write the tag on; the budget closes it after BUDGET tokens,
    and the tags written after the block are answer, which no budget holds."""
    method = METHODS[name]
    request = make_request(prompts[1], max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True,
                           logit_bias={OPEN: 100.0}, thinking_budget=_budget(starts_inside=False))
    tokens = tokens_alone(make_engine(model_dirs(method), method), request)
    assert tokens == [OPEN] * (1 + BUDGET) + [CLOSE] + [OPEN] * (NUM_TOKENS - BUDGET - 2)


@pytest.mark.parametrize("name", ["ngram", "mtp"])
def test_a_seeded_budgeted_request_gives_the_same_tokens_alone_or_batched(model_dirs, prompts, name) -> None:
    method = METHODS[name]
    model_dir = model_dirs(method)
    options = dict(max_tokens=NUM_TOKENS, temperature=1.0, seed=4, ignore_eos=True,
                   thinking_budget=_budget(starts_inside=True))
    alone = tokens_alone(make_engine(model_dir, method), make_request(prompts[0], **options))
    assert CLOSE in alone[: BUDGET + 1]
    copy = make_request(prompts[0], **options)
    others = [make_request(p, max_tokens=NUM_TOKENS, temperature=0.9, seed=1, ignore_eos=True) for p in prompts[1:3]]
    steps = run(make_engine(model_dir, method), {0: others[:1], 1: [copy, others[1]]})
    assert tokens_of(steps, copy) == alone
