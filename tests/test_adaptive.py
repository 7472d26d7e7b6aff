"""Adaptive speculation: drafts per request from acceptance and batch size under the step cost model, never
below plain decoding, the acceptance estimate, and the step cost calibration."""

from __future__ import annotations

import itertools
import random
import uuid

import pytest

from shared.config import SpeculativeConfig
from shared.schemas import SamplingParams
from shared.structured import StructuredOutput
from services.worker.drafting.controller import CONSTRAINED, GREEDY, SAMPLED, SpeculationController, _kind
from services.worker.engine.sequence import Sequence
from services.worker.drafting.adaptive import (
    AdaptiveSpeculation,
    SpeculationGate,
    StepCostModel,
    expected_tokens,
    modelled_throughput,
)

MAX_DRAFTS = 5
# A cost model where one token is 1% of a step's fixed cost: speculation pays at small batches.
C0, C1 = 1.0, 0.01


def _calibrated(c0: float = C0, c1: float = C1, c_draft: float | None = None) -> StepCostModel:
    """A cost model fitted from exact timings of this plane: c1 per sequence, c_draft (default c1) per draft row."""
    c_draft = c1 if c_draft is None else c_draft
    cost = StepCostModel()
    for num_seqs, num_drafts in ((1, 0), (1, 5), (64, 0), (64, 320), (256, 40)):
        cost.observe(num_seqs, num_drafts, c0 + c1 * num_seqs + c_draft * num_drafts)
    return cost


def _policy(**kwargs: object) -> AdaptiveSpeculation:
    return AdaptiveSpeculation(MAX_DRAFTS, cost=_calibrated(), **kwargs)


def _observe_many(policy: AdaptiveSpeculation, request_id: str, accepted: int, times: int = 30) -> None:
    for _ in range(times):
        policy.observe(request_id, MAX_DRAFTS, accepted)


def test_expected_tokens() -> None:
    assert expected_tokens(0.0, 3) == 1.0
    assert expected_tokens(1.0, 3) == 4.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_high_acceptance_at_a_small_batch_drafts_the_most() -> None:
    policy = _policy()
    _observe_many(policy, "a", MAX_DRAFTS)
    assert policy.choose(["a"], 1) == {"a": MAX_DRAFTS}


def test_low_acceptance_drafts_nothing() -> None:
    policy = _policy()
    _observe_many(policy, "a", 0)
    _observe_many(policy, "b", MAX_DRAFTS)
    assert policy.choose(["a", "b"], 2) == {"a": 0, "b": MAX_DRAFTS}


def test_a_large_batch_drafts_less() -> None:
    policy = _policy(prior_acceptance=0.7)
    ids = [f"r{i}" for i in range(256)]
    small = policy.choose(ids[:1], 1)["r0"]
    large = policy.choose(ids, len(ids))
    assert small == MAX_DRAFTS
    assert max(large.values()) < small
    # Sequences outside the choice (those that cannot draft) make the batch large too.
    assert policy.choose(["r0"], 1000)["r0"] < small


def test_speculation_stops_when_tokens_cost_all_the_time() -> None:
    policy = AdaptiveSpeculation(MAX_DRAFTS, cost=_calibrated(c0=0.0, c1=1e-3))
    _observe_many(policy, "a", MAX_DRAFTS - 1)
    assert policy.choose(["a"], 1) == {"a": 0}


def test_choice_is_optimal_and_never_below_plain_decoding() -> None:
    rng = random.Random(5)
    for _ in range(200):
        c0, c1 = rng.uniform(0.0, 1.0), rng.uniform(0.0, 0.5)
        policy = AdaptiveSpeculation(3, cost=_calibrated(c0, c1))
        ids = [f"r{i}" for i in range(rng.randint(1, 3))]
        for request_id in ids:
            for _ in range(10):
                drafted = rng.randint(1, 3)
                policy.observe(request_id, drafted, rng.randint(0, drafted))
        others = rng.randint(0, 4)
        alphas = [policy.acceptance(r) for r in ids]
        chosen = policy.choose(ids, len(ids) + others)
        fitted = policy.cost.coefficients
        value = modelled_throughput(alphas, [chosen[r] for r in ids], others, *fitted)
        every_choice = itertools.product(range(4), repeat=len(ids))
        best = max(modelled_throughput(alphas, list(ks), others, *fitted) for ks in every_choice)
        plain = modelled_throughput(alphas, [0] * len(ids), others, *fitted)
        assert value == pytest.approx(best, rel=1e-9)
        assert value >= plain


def test_acceptance_estimate_moves_from_the_prior_towards_observations() -> None:
    policy = _policy(prior_acceptance=0.6)
    assert policy.acceptance("a") == pytest.approx(0.6)
    policy.observe("a", 4, 4)
    high = policy.acceptance("a")
    assert high > 0.6
    _observe_many(policy, "a", 0)
    assert policy.acceptance("a") < 0.1
    # Drafts after the first rejection were never tried: 2 of 5 accepted is 2 of 3 tries.
    exact = AdaptiveSpeculation(MAX_DRAFTS, prior_weight=1e-9, memory=1.0)
    exact.observe("b", 5, 2)
    assert exact.acceptance("b") == pytest.approx(2 / 3)
    fresh = _policy(prior_acceptance=0.6)
    fresh.observe("c", 0, 0)  # nothing drafted: nothing learnt
    assert fresh.acceptance("c") == pytest.approx(0.6)
    assert fresh.pooled_acceptance() == pytest.approx(0.6)
    with pytest.raises(ValueError, match="num_accepted"):
        fresh.observe("c", 2, 3)


def test_a_new_request_starts_from_what_its_kind_was_recently_accepted() -> None:
    policy = _policy(prior_acceptance=0.6)
    for request_id, kind in (("sampled-0", "sampled"), ("greedy-0", "greedy")):
        policy.admit(request_id, kind)
    _observe_many(policy, "sampled-0", 0)
    _observe_many(policy, "greedy-0", MAX_DRAFTS)
    policy.forget("sampled-0")
    policy.forget("greedy-0")
    policy.admit("sampled-1", "sampled")
    policy.admit("greedy-1", "greedy")
    policy.admit("other", "other")
    assert policy.acceptance("sampled-1") < 0.2
    assert policy.acceptance("greedy-1") > 0.9
    assert policy.acceptance("other") == pytest.approx(0.6)  # a kind never observed starts from the prior
    batch_size = 10  # seven sequences beside them that do not draft
    assert policy.choose(["sampled-1", "greedy-1", "other"], batch_size)["sampled-1"] == 0
    assert policy.choose(["greedy-1"], 1) == {"greedy-1": MAX_DRAFTS}
    # Its own observations then take over, weighted like the prior: a surprising request moves at once.
    for _ in range(3):
        policy.observe("sampled-1", MAX_DRAFTS, MAX_DRAFTS)
    assert policy.acceptance("sampled-1") > 0.6
    policy.admit("sampled-1", "greedy")  # a request's kind is fixed when it is first seen
    assert policy.acceptance("sampled-1") > 0.6


def test_a_request_without_drafts_drifts_back_to_its_kinds_pool_and_the_pool_to_the_prior() -> None:
    policy = _policy(prior_acceptance=0.6)
    _observe_many(policy, "a", 0)
    _observe_many(policy, "b", MAX_DRAFTS)
    batch_size = 10  # eight sequences beside them that do not draft
    assert policy.choose(["a", "b"], batch_size)["a"] == 0
    pooled = policy.pooled_acceptance()
    for _ in range(300):
        policy.choose(["a"], batch_size)
    assert policy.choose(["a"], batch_size)["a"] > 0
    policy.forget("a")
    policy.forget("b")
    for _ in range(5000):  # nobody drafts: the pool forgets what it saw
        policy.choose([], batch_size)
    assert abs(policy.pooled_acceptance() - 0.6) < 0.02 * abs(pooled - 0.6)


def test_calibration_recovers_the_coefficients_from_noisy_timings() -> None:
    rng = random.Random(9)
    c0, c_seq, c_draft = 4e-3, 1.7e-4, 3.5e-5  # the demo model's CPU step: a draft row ~5x cheaper than a sequence
    policy = AdaptiveSpeculation(MAX_DRAFTS)
    for _ in range(2000):
        num_seqs = rng.randint(1, 64)
        num_drafts = num_seqs * rng.randint(0, MAX_DRAFTS)
        seconds = (c0 + c_seq * num_seqs + c_draft * num_drafts) * rng.uniform(0.95, 1.05)
        policy.observe_step(num_seqs, num_drafts, seconds)
    fit = policy.cost.coefficients
    assert fit == pytest.approx((c0, c_seq, c_draft), rel=0.1)


def test_cheap_draft_rows_keep_a_large_batch_drafting() -> None:
    """With draft rows priced as what they cost (a fifth of a sequence), a batch of 32 with good acceptance keeps
    drafting; priced like a sequence, as a one-coefficient model prices them, it drafts far less."""
    cheap = AdaptiveSpeculation(MAX_DRAFTS, cost=_calibrated(c0=1.0, c1=0.05, c_draft=0.01))
    dear = AdaptiveSpeculation(MAX_DRAFTS, cost=_calibrated(c0=1.0, c1=0.05))
    ids = [str(i) for i in range(32)]
    for policy in (cheap, dear):
        for request_id in ids:
            _observe_many(policy, request_id, 4)
    drafted = [sum(policy.choose(ids, 32).values()) for policy in (cheap, dear)]
    assert drafted[0] > 2 * drafted[1] > 0


def test_forgetting_follows_a_change_in_cost() -> None:
    cost = StepCostModel(forgetting=0.99)
    rng = random.Random(2)
    for c0, c_seq, c_draft in [(1.0, 0.1, 0.1), (2.0, 0.01, 0.002)]:
        for _ in range(2000):
            num_seqs, num_drafts = rng.randint(1, 100), rng.randint(0, 300)
            cost.observe(num_seqs, num_drafts, c0 + c_seq * num_seqs + c_draft * num_drafts)
    assert cost.coefficients == pytest.approx((2.0, 0.01, 0.002), rel=1e-3)


def test_what_timings_cannot_separate_falls_back() -> None:
    cost = StepCostModel(token_cost_ratio=0.05)
    assert cost.coefficients == pytest.approx((1.0, 0.05, 0.05))
    for _ in range(10):
        cost.observe(8, 0, 0.02)  # a single shape cannot separate anything: the prior ratio at the mean
    c0, c_seq, c_draft = cost.coefficients
    assert c_seq / c0 == pytest.approx(0.05) and c_draft == c_seq
    assert c0 + 8 * c_seq == pytest.approx(0.02)

    steady = StepCostModel()  # the same 8 sequences, drafting more or less: the draft rows alone are fitted
    for num_drafts in (0, 8, 16, 24):
        steady.observe(8, num_drafts, 1.0 + 0.1 * 8 + 0.01 * num_drafts)
    assert steady.coefficients == pytest.approx((1.8, 0.0, 0.01))

    plain = StepCostModel()  # never a draft: a draft row is priced like a sequence
    for num_seqs in (1, 8, 32):
        plain.observe(num_seqs, 0, 1.0 + 0.1 * num_seqs)
    assert plain.coefficients == pytest.approx((1.0, 0.1, 0.1))


def test_invalid_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="prior_acceptance"):
        AdaptiveSpeculation(MAX_DRAFTS, prior_acceptance=1.5)
    with pytest.raises(ValueError, match="batch_size"):
        _policy().choose(["a", "b"], 1)
    with pytest.raises(ValueError, match="forgetting"):
        StepCostModel(forgetting=0.0)
    assert AdaptiveSpeculation(0).choose(["a"], 1) == {"a": 0}


def test_gate_measures_both_modes_then_keeps_the_faster_with_probes() -> None:
    gate = SpeculationGate(probe_every=4)
    assert gate.speculate(8) is False  # plain decoding is measured first
    gate.observe(8, False, num_tokens=8, seconds=1.0)
    assert gate.speculate(8) is True  # then speculation
    gate.observe(8, True, num_tokens=12, seconds=2.0)  # slower: 6 tokens/s against 8
    decisions = [gate.speculate(8) for _ in range(8)]
    assert decisions.count(True) == 2  # only the probes speculate
    gate.observe(8, True, num_tokens=40, seconds=1.0)  # speculation now measured faster
    gate.observe(8, True, num_tokens=40, seconds=1.0)
    assert [gate.speculate(8) for _ in range(4)].count(True) == 3


def test_gate_keeps_batch_sizes_apart() -> None:
    gate = SpeculationGate()
    gate.observe(1, False, 1, 1.0)
    gate.observe(1, True, 3, 1.0)
    assert gate.speculate(1) is True
    assert gate.speculate(32) is False  # nothing measured at this batch size yet


def test_adaptive_by_default_where_drafts_do_not_change_seeded_output() -> None:
    """Point-mass drafters (ngram, suffix) give a seeded request the same tokens whatever number of drafts a step
    verifies, so they adapt by default; MTP under rejection would not, so it keeps a fixed number unless asked."""
    assert SpeculativeConfig(method="ngram").adaptive_drafts
    assert SpeculativeConfig(method="suffix").adaptive_drafts
    assert not SpeculativeConfig(method="mtp").adaptive_drafts
    assert SpeculativeConfig(method="mtp", adaptive=True).adaptive_drafts
    assert not SpeculativeConfig(method="ngram", adaptive=False).adaptive_drafts


def test_each_request_pools_with_its_kind_and_constrained_ones_apart() -> None:
    """A constrained request's drafts include the tokens its grammar forces, always accepted: pooled with the others,
    they would start every new request of its sampling kind drafting as if its text were predictable."""
    def seq(**sampling) -> Sequence:
        return Sequence(uuid.uuid4().hex, [1, 2, 3], SamplingParams(max_tokens=4, **sampling), 0, frozenset())

    assert _kind(seq(temperature=0.0)) == GREEDY
    assert _kind(seq(temperature=0.7)) == SAMPLED
    constrained = seq(temperature=0.7, structured=StructuredOutput(kind="regex", spec="x+"))
    assert _kind(constrained) == CONSTRAINED
    controller = SpeculationController(SpeculativeConfig(method="ngram"), max_model_len=64)
    plain = seq(temperature=0.7)
    controller.begin_step([constrained, plain])
    for _ in range(30):
        controller.observe(constrained, 3, 3)
        controller.observe(plain, 3, 0)
    assert controller.adaptive.pooled_acceptance(CONSTRAINED) > 0.9
    assert controller.adaptive.pooled_acceptance(SAMPLED) < 0.2
