"""Draft verification: greedy and debugging policies, and losslessness of the rejection rule, tested statistically."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from services.worker.sampling.random import Purpose, uniform
from services.worker.sampling.rejection import PAD_TOKEN, VerifyInput, VerifyOutput, verify
from services.worker.sampling.sample import sample

TRIALS = 20_000
# The verdicts below are fixed outcomes (seeds are fixed), not flaky draws: the correct rule must look like p
# (p-value above ACCEPT_P_VALUE), a wrong rule must be unmistakably off (p-value below REJECT_P_VALUE).
ACCEPT_P_VALUE = 1e-3
REJECT_P_VALUE = 1e-9

P = torch.tensor([0.40, 0.25, 0.20, 0.10, 0.05], dtype=torch.float64)
Q = torch.tensor([0.10, 0.15, 0.20, 0.25, 0.30], dtype=torch.float64)


def _chi2_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit; the survival function has a closed form for even degrees of freedom."""
    total = float(counts.sum())
    expected = probs.double() * total
    statistic = float(((counts.double() - expected) ** 2 / expected).sum())
    dof = len(probs) - 1
    assert dof % 2 == 0, "the closed form below needs an even number of degrees of freedom"
    half = statistic / 2
    return math.exp(-half) * sum(half**i / math.factorial(i) for i in range(dof // 2))


def _inputs(
    target_rows: list[torch.Tensor],
    draft_rows: list[torch.Tensor] | None,
    trials: int = TRIALS,
    num_drafts: int | None = None,
) -> VerifyInput:
    """`trials` rows with the same p (and q) tables; drafts sampled from q, or token 0 for point-mass proposals."""
    num_slots = len(target_rows) - 1
    seeds = torch.arange(trials, dtype=torch.int64) + 1_000
    positions = torch.full((trials,), 17, dtype=torch.int64)
    target = torch.stack(target_rows).unsqueeze(0).expand(trials, -1, -1).contiguous()
    if draft_rows is None:
        draft_probs = None
        draft_tokens = torch.zeros(trials, num_slots, dtype=torch.int64)
    else:
        draft_probs = torch.stack(draft_rows).unsqueeze(0).expand(trials, -1, -1).contiguous()
        draft_tokens = torch.stack(
            [sample(draft_probs[:, j], seeds, positions + j, Purpose.DRAFT) for j in range(num_slots)], dim=1
        )
    return VerifyInput(
        target_probs=target,
        draft_tokens=draft_tokens,
        num_drafts=torch.full((trials,), num_slots if num_drafts is None else num_drafts, dtype=torch.int64),
        draft_probs=draft_probs,
        greedy=torch.zeros(trials, dtype=torch.bool),
        seeds=seeds,
        positions=positions,
    )


def _first_token_counts(out: VerifyOutput, vocab: int) -> torch.Tensor:
    return torch.bincount(out.output_tokens[:, 0], minlength=vocab)


def _one_draft_wrong_rule(inp: VerifyInput, accept: Callable, recover_from: Callable) -> torch.Tensor:
    """The first emitted token of a one-draft step under a given (deliberately wrong) rule, with verify's noise."""
    drafted = inp.draft_tokens[:, 0]
    p = inp.target_probs[:, 0]
    q = inp.draft_probs[:, 0]
    p_x = p.gather(1, drafted.unsqueeze(1)).squeeze(1)
    q_x = q.gather(1, drafted.unsqueeze(1)).squeeze(1)
    u = uniform(inp.seeds, inp.positions, Purpose.ACCEPT)
    recovered = sample(recover_from(p, q), inp.seeds, inp.positions, Purpose.SAMPLE)
    return torch.where(accept(u, p_x, q_x), drafted, recovered)


def _normalised_residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    residual = (p - q).clamp(min=0)
    return residual / residual.sum(dim=-1, keepdim=True)


def test_one_draft_step_emits_exactly_p() -> None:
    out = verify(_inputs([P, P], [Q]))
    assert _chi2_p_value(_first_token_counts(out, 5), P) > ACCEPT_P_VALUE
    expected_acceptance = float(torch.minimum(P, Q).sum())
    assert abs(float(out.num_accepted.double().mean()) - expected_acceptance) < 0.02


def test_the_same_check_catches_wrong_rules() -> None:
    inp = _inputs([P, P], [Q])
    correct = _one_draft_wrong_rule(inp, lambda u, p_x, q_x: u * q_x < p_x, _normalised_residual)
    assert torch.equal(correct, verify(inp).output_tokens[:, 0])  # the harness reproduces verify exactly

    accept_with_p = _one_draft_wrong_rule(inp, lambda u, p_x, q_x: u < p_x, _normalised_residual)
    recover_from_p = _one_draft_wrong_rule(inp, lambda u, p_x, q_x: u * q_x < p_x, lambda p, q: p)
    for wrong in (accept_with_p, recover_from_p):
        assert _chi2_p_value(torch.bincount(wrong, minlength=5), P) < REJECT_P_VALUE


def test_every_position_of_a_multi_draft_step_follows_p() -> None:
    p_rows = [P, P.flip(0), torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2], dtype=torch.float64)]
    q_rows = [Q, torch.tensor([0.3, 0.3, 0.2, 0.1, 0.1], dtype=torch.float64)]
    out = verify(_inputs(p_rows, q_rows))
    for position, p in enumerate(p_rows):
        # The token at `position` is emitted when the drafts before it were accepted; given that, it must be p.
        reached = out.num_accepted >= position
        counts = torch.bincount(out.output_tokens[reached, position], minlength=5)
        assert int(counts.sum()) > 2_000
        assert _chi2_p_value(counts, p) > ACCEPT_P_VALUE, position


def test_point_mass_proposals_are_lossless() -> None:
    inp = _inputs([P, P], None)
    out = verify(inp)
    assert _chi2_p_value(_first_token_counts(out, 5), P) > ACCEPT_P_VALUE
    assert abs(float(out.num_accepted.double().mean()) - float(P[0])) < 0.02


def test_point_mass_recovery_never_repeats_the_rejected_draft() -> None:
    out = verify(_inputs([P, P], None, trials=2_000))
    rejected = out.num_accepted == 0
    assert bool(rejected.any()) and bool((out.output_tokens[rejected, 0] != 0).all())


def test_no_drafts_emits_what_plain_decoding_samples() -> None:
    inp = _inputs([P, P], [Q], trials=500, num_drafts=0)
    out = verify(inp)
    assert torch.equal(out.output_tokens[:, 0], sample(inp.target_probs[:, 0], inp.seeds, inp.positions))
    assert bool((out.num_accepted == 0).all()) and bool((out.output_tokens[:, 1] == PAD_TOKEN).all())


def _one_hot(tokens: list[int], vocab: int = 6) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).to(torch.float32)


def _greedy_input(argmax_rows: list[list[int]], drafts: list[list[int]], num_drafts: list[int]) -> VerifyInput:
    batch = len(drafts)
    return VerifyInput(
        target_probs=torch.stack([_one_hot(row) for row in argmax_rows]),
        draft_tokens=torch.tensor(drafts, dtype=torch.int64),
        num_drafts=torch.tensor(num_drafts, dtype=torch.int64),
        draft_probs=None,
        greedy=torch.ones(batch, dtype=torch.bool),
        seeds=torch.arange(batch, dtype=torch.int64),
        positions=torch.zeros(batch, dtype=torch.int64),
    )


def test_greedy_accepts_while_draft_is_argmax_then_takes_argmax() -> None:
    inp = _greedy_input(
        argmax_rows=[[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]],
        drafts=[[1, 2, 3], [1, 5, 3], [0, 2, 3], [1, 2, PAD_TOKEN]],
        num_drafts=[3, 3, 3, 2],
    )
    out = verify(inp)
    assert out.num_accepted.tolist() == [3, 1, 0, 2]
    assert out.num_emitted.tolist() == [4, 2, 1, 3]
    assert out.output_tokens.tolist() == [
        [1, 2, 3, 4],
        [1, 2, PAD_TOKEN, PAD_TOKEN],
        [1, PAD_TOKEN, PAD_TOKEN, PAD_TOKEN],
        [1, 2, 3, PAD_TOKEN],
    ]


def test_greedy_ignores_acceptance_noise_with_a_soft_target() -> None:
    # p favours token 2 only slightly; a sampled row would sometimes reject it, a greedy row never does.
    p = torch.tensor([0.3, 0.3, 0.4], dtype=torch.float64)
    inp = _inputs([p, p], None, trials=1_000)
    inp.draft_tokens[:] = 2
    inp.greedy[:] = True
    out = verify(inp)
    assert bool((out.num_accepted == 1).all()) and bool((out.output_tokens[:, 1] == 2).all())


def test_accept_all_and_reject_all() -> None:
    inp = _inputs([P, P, P], [Q, Q], trials=300)
    inp.num_drafts[:100] = 1
    everything = verify(inp, accept_policy="accept_all")
    assert torch.equal(everything.num_accepted, inp.num_drafts)
    assert torch.equal(everything.output_tokens[100:, :2], inp.draft_tokens[100:])

    nothing = verify(inp, accept_policy="reject_all")
    assert bool((nothing.num_accepted == 0).all())
    # Nothing was rejected by a test, so the emitted token is what plain decoding would sample.
    assert torch.equal(nothing.output_tokens[:, 0], sample(inp.target_probs[:, 0], inp.seeds, inp.positions))


def test_rows_do_not_depend_on_the_batch() -> None:
    inp = _inputs([P, P, P], [Q, Q], trials=64)
    whole = verify(inp)
    part = slice(10, 13)
    alone = verify(
        VerifyInput(
            target_probs=inp.target_probs[part],
            draft_tokens=inp.draft_tokens[part],
            num_drafts=inp.num_drafts[part],
            draft_probs=inp.draft_probs[part],
            greedy=inp.greedy[part],
            seeds=inp.seeds[part],
            positions=inp.positions[part],
        )
    )
    assert torch.equal(alone.output_tokens, whole.output_tokens[part])


def test_bad_shapes_and_policy_are_refused() -> None:
    inp = _inputs([P, P], [Q], trials=4)
    with pytest.raises(ValueError, match="accept_policy"):
        verify(inp, accept_policy="sometimes")
    inp.positions = inp.positions[:3]
    with pytest.raises(ValueError, match="positions"):
        verify(inp)


def test_a_batch_without_any_draft_slot() -> None:
    probs = P.to(torch.float32).expand(8, 1, 5).contiguous()
    seeds = torch.arange(8, dtype=torch.int64)
    positions = torch.full((8,), 3, dtype=torch.int64)
    out = verify(
        VerifyInput(
            target_probs=probs,
            draft_tokens=torch.empty(8, 0, dtype=torch.int64),
            num_drafts=torch.zeros(8, dtype=torch.int64),
            draft_probs=None,
            greedy=torch.zeros(8, dtype=torch.bool),
            seeds=seeds,
            positions=positions,
        )
    )
    assert out.output_tokens.shape == (8, 1)
    assert torch.equal(out.output_tokens[:, 0], sample(probs[:, 0], seeds, positions))
