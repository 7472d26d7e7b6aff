"""Reproducible randomness (issue #3 §3) at the engine level: a seeded request yields the same tokens alone or in
any batch; with target_match it yields exactly plain decoding's tokens whatever the drafter and k; the engine
leaves the global RNGs alone; unseeded requests draw a fresh seed and log it. Plus one distribution check of the
whole engine: sampled tokens under rejection with n-gram drafts are distributed as under plain decoding, and a
deliberately wrong acceptance rule is caught."""

from __future__ import annotations

import logging
import math
import random
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from services.worker.engine.engine import Engine
from shared.schemas import WorkRequest
from tests.methodfixture import (  # noqa: F401  (fixtures are used by name)
    GREEDY, METHOD_NAMES, METHODS, greedy_reference, make_engine, make_request, model_dirs, mtp_model_dir,
    mtp_model_dirs, prompts, reference_model, run, single_thread, tiny_model_dir, tokens_alone, tokens_of,
)

pytest.importorskip("transformers")

ENGINE_LOGGER = "services.worker.engine.engine"
# A seed that enters no other test here, so that coincidences with other requests cannot make a test pass.
SEED = 917
# The tiny random model's distribution is nearly flat (top p ~ 1.6 / vocab); at this temperature a sampled row
# follows the text its drafts come from, so sampled rows have drafts accepted.
LOW_TEMPERATURE = 0.001
TARGET_MATCH_METHODS = ("ngram", "suffix", "mtp", "mtp+with_ngram")
NUM_DRAFTS = (1, 2, 3, 4)

# Engine-level losslessness: the second output token (the first one a verify step emits; the first comes
# from prefill, which verifies nothing) over many seeds, under rejection with n-gram drafts and plain decoding.
NUM_SEEDS = 400
CHI_SQUARE_TOP_K = 4  # a truncated target, so that the token falls into few bins with solid counts
# With this temperature about half the first drafts get accepted under rejection, and half the requests draft.
CHI_SQUARE_TEMPERATURE = 0.1
LOOP_TOKENS = 39  # the looping prompt's greedy continuation, cut where it is still inside its cycle
CYCLE = 3  # the length of that cycle
MIN_BIN_COUNT = 10  # bins with fewer tokens (both samples together) are pooled into one
Z_ALPHA = 3.0902  # the standard normal's upper 0.1% point: the test rejects equal distributions 1 in 1000
DISTRIBUTION_MAX_MODEL_LEN = 128


def _sampled_requests(prompts: list[list[int]], seed: int = SEED) -> list[WorkRequest]:
    """Seeded sampled requests of several kinds: near-greedy (drafts accepted), plain, top-k with top-p."""
    return [
        make_request(prompts[0], max_tokens=24, temperature=LOW_TEMPERATURE, seed=seed, ignore_eos=True),
        make_request(prompts[1], max_tokens=20, temperature=0.8, seed=seed + 1, ignore_eos=True),
        make_request(prompts[3], max_tokens=16, temperature=1.0, top_k=50, top_p=0.9, seed=seed + 2,
                     ignore_eos=True),
    ]


def _copy(request: WorkRequest) -> WorkRequest:
    """The same request under a new id (an engine refuses nothing, but ids must stay unique per run)."""
    return make_request(list(request.prompt_token_ids), **request.sampling.model_dump())


@pytest.mark.parametrize("name", METHOD_NAMES)
def test_seeded_request_yields_the_same_tokens_alone_or_in_any_batch(model_dirs, prompts, name) -> None:
    method = METHODS[name]
    model_dir = model_dirs(method)
    # Suffix drafts depend on what other requests already produced; under rejection, point-mass drafts are
    # verified in the coupled form (sampling/rejection.py), so the output still cannot depend on them.
    def make(max_num_seqs: int = 4) -> Engine:
        return make_engine(model_dir, method, max_num_seqs=max_num_seqs, verify_strategy="rejection")

    requests = _sampled_requests(prompts)
    alone = [tokens_alone(make(), r) for r in requests]

    # All together, beside greedy rows, in the order given.
    together = [_copy(r) for r in requests]
    fillers = [make_request(p, max_tokens=12, **GREEDY) for p in prompts[:2]]
    steps = run(make(8), {0: [fillers[0], *together, fillers[1]]})
    assert [tokens_of(steps, r) for r in together] == alone

    # In reverse order, arriving at different steps, with two slots: they wait, and take other slots.
    late = [_copy(r) for r in requests]
    others = [make_request(prompts[2], max_tokens=6, temperature=0.9, seed=1, ignore_eos=True)]
    steps = run(make(2), {0: [others[0], late[2]], 2: [late[1]], 5: [late[0]]})
    assert [tokens_of(steps, r) for r in late] == alone


@pytest.fixture(scope="module")
def naive_tokens(tiny_model_dir: Path, prompts) -> list[list[int]]:  # noqa: F811
    """Plain decoding's tokens for _sampled_requests."""
    requests = _sampled_requests(prompts)
    steps = run(make_engine(tiny_model_dir, METHODS["naive"]), {0: requests})
    return [tokens_of(steps, r) for r in requests]


@pytest.mark.parametrize("k", NUM_DRAFTS)
@pytest.mark.parametrize("name", TARGET_MATCH_METHODS)
def test_target_match_yields_exactly_the_tokens_of_plain_decoding(model_dirs, prompts, naive_tokens, name, k) -> None:
    method = METHODS[name]
    overrides = dict(num_speculative_tokens=k, verify_strategy="target_match")
    if method.method == "mtp" and method.options.get("mtp_strategy") != "with_ngram":
        overrides["num_model_steps"] = k  # the module drafts all k by feeding itself
    engine = make_engine(model_dirs(method), method, **overrides)
    requests = _sampled_requests(prompts)
    steps = run(engine, {0: requests})
    assert [tokens_of(steps, r) for r in requests] == naive_tokens
    assert engine.stats.num_accepted_tokens > 0  # drafts did replace target samples


@pytest.mark.parametrize("name", ["ngram", "mtp"])
def test_target_match_with_adaptive_drafts_yields_the_tokens_of_plain_decoding(
    model_dirs, prompts, naive_tokens, name
) -> None:
    """Adaptive speculation changes the number of drafts with the batch and the measured step times; under
    target_match that changes only the number of steps."""
    method = METHODS[name]
    engine = make_engine(model_dirs(method), method, verify_strategy="target_match", adaptive=True)
    requests = _sampled_requests(prompts)
    steps = run(engine, {0: requests})
    assert [tokens_of(steps, r) for r in requests] == naive_tokens
    # Which steps draft follows measured step times (the gate), so how many drafts are accepted is not fixed;
    # the gate always measures speculation once per batch size, so drafts are verified.
    assert engine.stats.num_draft_tokens > 0


def _rng_states() -> tuple:
    return torch.random.get_rng_state(), np.random.get_state(), random.getstate()


def _assert_same_rng_states(before: tuple, after: tuple) -> None:
    assert torch.equal(before[0], after[0]), "the engine used the global torch RNG"
    (name, keys, *counters), (name_after, keys_after, *counters_after) = before[1], after[1]
    assert name == name_after and np.array_equal(keys, keys_after) and counters == counters_after, (
        "the engine used numpy's global RNG"
    )
    assert before[2] == after[2], "the engine used Python's global random module"


@pytest.mark.parametrize("name", METHOD_NAMES)
def test_engine_never_touches_the_global_rngs(model_dirs, prompts, name) -> None:
    method = METHODS[name]
    unseeded = make_request(prompts[2], max_tokens=10, temperature=1.0, ignore_eos=True)
    before = _rng_states()
    steps = run(make_engine(model_dirs(method), method), {0: [*_sampled_requests(prompts), unseeded]})
    _assert_same_rng_states(before, _rng_states())
    assert len(tokens_of(steps, unseeded)) == 10


def test_unseeded_requests_draw_fresh_seeds_and_log_them(tiny_model_dir, prompts, caplog) -> None:  # noqa: F811
    method = METHODS["ngram"]
    params = dict(max_tokens=16, temperature=1.0, ignore_eos=True)
    first, second = make_request(prompts[0], **params), make_request(prompts[0], **params)
    seeded = make_request(prompts[0], seed=SEED, **params)
    with caplog.at_level(logging.DEBUG, logger=ENGINE_LOGGER):
        steps = run(make_engine(tiny_model_dir, method), {0: [first, second, seeded]})
    logged = {}
    for record in caplog.records:
        match = re.fullmatch(r"request (\w+) runs with seed (\d+)", record.getMessage())
        if record.name == ENGINE_LOGGER and match:
            assert record.levelno == logging.DEBUG
            logged[match[1]] = int(match[2])
    assert set(logged) == {first.request_id, second.request_id}  # a seeded request has no seed to report
    assert logged[first.request_id] != logged[second.request_id]
    # 16 tokens from a nearly flat distribution over the vocabulary: equal only if the seeds were.
    assert tokens_of(steps, first) != tokens_of(steps, second)
    for request in (first, second):  # the logged seed reproduces the output
        again = make_request(prompts[0], seed=logged[request.request_id], **params)
        assert tokens_alone(make_engine(tiny_model_dir, method), again) == tokens_of(steps, request)


def second_tokens(engine: Engine, prompt: list[int], first_seed: int) -> list[int]:
    requests = [
        # max_tokens 3: room for one draft after prefill's token, besides the token verification adds.
        make_request(prompt, max_tokens=3, temperature=CHI_SQUARE_TEMPERATURE, top_k=CHI_SQUARE_TOP_K,
                     seed=first_seed + i, ignore_eos=True)
        for i in range(NUM_SEEDS)
    ]
    steps = run(engine, {0: requests})
    return [tokens_of(steps, r)[1] for r in requests]


def chi_square_homogeneity(a: list[int], b: list[int]) -> tuple[float, int]:
    """Pearson's statistic that two equal-sized samples come from one distribution, and its degrees of freedom."""
    assert len(a) == len(b)
    count_a, count_b = Counter(a), Counter(b)
    bins: list[tuple[int, int]] = []
    pooled = [0, 0]
    for value in count_a.keys() | count_b.keys():
        pair = (count_a[value], count_b[value])
        if sum(pair) < MIN_BIN_COUNT:
            pooled = [pooled[0] + pair[0], pooled[1] + pair[1]]
        else:
            bins.append(pair)
    if sum(pooled):
        bins.append(tuple(pooled))
    # With equal sample sizes each bin's expected count is the mean of the two, which reduces Pearson's sum to:
    return sum((x - y) ** 2 / (x + y) for x, y in bins), len(bins) - 1


def chi_square_critical(dof: int, z: float = Z_ALPHA) -> float:
    """The chi-square quantile whose normal score is z (Wilson-Hilferty; within 1% from 3 degrees of freedom)."""
    scale = 2.0 / (9.0 * dof)
    return dof * (1.0 - scale + z * math.sqrt(scale)) ** 3


@pytest.fixture(scope="module")
def looping_prompt(prompts, greedy_reference) -> list[int]:
    """A prompt ending inside a cycle its greedy continuation repeats: prompt lookup drafts likely tokens."""
    looping = prompts[1] + greedy_reference(prompts[1], LOOP_TOKENS)
    assert looping[-CYCLE:] == looping[-2 * CYCLE : -CYCLE]
    return looping


def test_rejection_with_ngram_drafts_keeps_the_target_distribution(
    tiny_model_dir, looping_prompt  # noqa: F811
) -> None:
    def engine(method: str, accept_policy: str = "normal") -> Engine:
        return make_engine(
            tiny_model_dir, METHODS[method], num_speculative_tokens=1, max_num_seqs=NUM_SEEDS,
            max_model_len=DISTRIBUTION_MAX_MODEL_LEN, accept_policy=accept_policy,
            **({"min_ngram_size": 1} if method == "ngram" else {}),  # draft whenever the token occurred before
        )

    # Disjoint seeds, so that the samples are independent (the same seed would pair their noise).
    plain = second_tokens(engine("naive"), looping_prompt, 0)
    speculative_engine = engine("ngram")
    speculative = second_tokens(speculative_engine, looping_prompt, NUM_SEEDS)
    stats = speculative_engine.stats
    # Non-vacuous: most requests had a draft to verify, and both outcomes of the test occurred often.
    assert stats.num_drafts > NUM_SEEDS / 3
    assert NUM_SEEDS / 10 < stats.num_accepted_tokens < stats.num_draft_tokens - NUM_SEEDS / 10
    statistic, dof = chi_square_homogeneity(plain, speculative)
    assert dof >= 3 and statistic < chi_square_critical(dof), (statistic, dof)

    wrong = second_tokens(engine("ngram", "accept_all"), looping_prompt, NUM_SEEDS)
    statistic, dof = chi_square_homogeneity(plain, wrong)
    assert statistic > chi_square_critical(dof), (statistic, dof)
