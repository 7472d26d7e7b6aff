"""Verification on the CPU's own paths gives verify_torch's tokens and counts, bit for bit, with greedy rows, rows
without drafts and every accepted length in the batch: coupled verification slot by slot (sampling/coupled.py) for
point-mass drafts under rejection and any drafts under target_match, and the rejection rule for modelled drafts in
numpy (sampling/host_rejection.py), in float32 and float64, for batches of one to a few rows (whose noise is hashed
in Python's integers), without draft slots, all greedy, and with a q equal to p (an empty residual); each applies
exactly where it should."""

from __future__ import annotations

import pytest
import torch

from services.worker.sampling.coupled import is_coupled, verify_coupled
from services.worker.sampling.host_rejection import is_host_rejection, verify_host_rejection
from services.worker.sampling.random import Purpose
from services.worker.sampling.rejection import PAD_TOKEN, VerifyInput, verify_torch
from services.worker.sampling.sample import sample_torch

BATCH, SLOTS, VOCAB = 48, 4, 300
MATCH_SHARE = 0.75  # drafts copy the target's own sample this often, so that long accepted prefixes occur


def _inputs(seed: int, with_q: bool, dtype: torch.dtype = torch.float32, batch: int = BATCH,
            slots: int = SLOTS) -> VerifyInput:
    g = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(batch, slots + 1, VOCAB, generator=g) * 2, dim=-1).to(dtype)
    seeds = torch.randint(-(2**63), 2**63 - 1, (batch,), generator=g)
    positions = torch.randint(0, 1000, (batch,), generator=g)
    own = [sample_torch(target[:, j], seeds, positions + j, Purpose.SAMPLE) for j in range(slots)]
    own = torch.stack(own, 1) if slots else torch.zeros(batch, 0, dtype=torch.int64)
    other = torch.randint(0, VOCAB, (batch, slots), generator=g)
    drafts = torch.where(torch.rand(batch, slots, generator=g) < MATCH_SHARE, own, other)
    num_drafts = torch.randint(0, slots + 1, (batch,), generator=g)
    drafts = torch.where(torch.arange(slots) < num_drafts.unsqueeze(1), drafts, PAD_TOKEN)
    # q near p, so that modelled drafts are often accepted too
    noise = torch.randn(batch, slots, VOCAB, generator=g)
    q = torch.softmax(target[:, :slots].float().log() + noise, dim=-1) if with_q else None
    return VerifyInput(
        target_probs=target, draft_tokens=drafts, num_drafts=num_drafts, draft_probs=q,
        greedy=torch.rand(batch, generator=g) < 0.25, seeds=seeds, positions=positions,
    )


def _assert_same(got, expected) -> None:
    assert got is not None
    assert torch.equal(got.num_accepted, expected.num_accepted)
    assert torch.equal(got.output_tokens, expected.output_tokens)
    assert torch.equal(got.num_emitted, expected.num_emitted) and torch.equal(got.offsets, expected.offsets)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("strategy, with_q", [("rejection", False), ("target_match", False), ("target_match", True)])
def test_slot_by_slot_equals_verify_torch(seed: int, strategy: str, with_q: bool) -> None:
    inp = _inputs(seed, with_q)
    assert is_coupled(inp, "normal", strategy)
    got = verify_coupled(inp)
    _assert_same(got, verify_torch(inp, "normal", strategy))
    assert set(got.num_accepted.tolist()) == set(range(SLOTS + 1))  # every accepted length was exercised


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_host_rejection_rule_equals_verify_torch(seed: int, dtype: torch.dtype) -> None:
    inp = _inputs(seed, True, dtype)
    assert is_host_rejection(inp, "normal", "rejection")
    got = verify_host_rejection(inp)
    _assert_same(got, verify_torch(inp, "normal", "rejection"))
    assert set(got.num_accepted.tolist()) == set(range(SLOTS + 1))


@pytest.mark.parametrize("batch, slots", [(1, 3), (3, 2), (4, 1), (5, 0)])
@pytest.mark.parametrize("all_greedy", [False, True])
def test_small_batches_without_slots_or_all_greedy(batch: int, slots: int, all_greedy: bool) -> None:
    for seed in range(8):
        for with_q, strategy in ((False, "rejection"), (True, "rejection"), (True, "target_match")):
            inp = _inputs(seed, with_q, batch=batch, slots=slots)
            if all_greedy:
                inp.greedy = torch.ones(batch, dtype=torch.bool)
            got = verify_coupled(inp) if is_coupled(inp, "normal", strategy) else verify_host_rejection(inp)
            _assert_same(got, verify_torch(inp, "normal", strategy))


def test_a_rejected_draft_whose_residual_is_empty_samples_from_p() -> None:
    """Where q covers p everywhere (q >= p, which float rounding can also produce at q == p) a rejection leaves an
    empty residual max(p - q, 0), and both paths sample the emitted token from p itself."""
    inp = _inputs(0, True)
    inp.greedy[:] = False
    inp.draft_probs = (2 * inp.target_probs[:, :SLOTS]).clamp(max=0.99)  # q >= p: about half the drafts rejected
    got = verify_host_rejection(inp)
    _assert_same(got, verify_torch(inp, "normal", "rejection"))
    assert (got.num_accepted < inp.num_drafts).any()


def test_a_drafted_slot_without_a_token_is_left_to_verify_torch() -> None:
    inp = _inputs(0, False)
    row = int((inp.num_drafts > 0).nonzero()[0])
    inp.draft_tokens[row, 0] = PAD_TOKEN
    assert verify_coupled(inp) is None


def test_a_point_mass_q_is_left_to_verify_torch() -> None:
    inp = _inputs(0, True)
    drafted = inp.num_drafts > 0
    row = int(drafted.nonzero()[0])
    inp.draft_probs[row, 0] = 0.0
    inp.draft_probs[row, 0, inp.draft_tokens[row, 0]] = 1.0  # MTP's with_ngram filler drafts such slots
    assert verify_host_rejection(inp) is None


def test_each_applies_where_it_should() -> None:
    point_mass, with_q = _inputs(0, False), _inputs(0, True)
    assert not is_coupled(with_q, "normal", "rejection")  # u < p/q: one uniform a slot, no race
    assert not is_coupled(point_mass, "accept_all", "rejection")
    assert not is_coupled(point_mass, "normal", "greedy") and not is_coupled(point_mass, "normal", "topp")
    assert not is_host_rejection(point_mass, "normal", "rejection") and not is_host_rejection(with_q, "normal", "topp")
    assert not is_host_rejection(with_q, "reject_all", "rejection")
    with_q.target_probs = with_q.target_probs.bfloat16()  # numpy has no bfloat16
    assert not is_host_rejection(with_q, "normal", "rejection")
