"""Verification on the CPU's own paths gives verify_torch's tokens and counts, bit for bit, with greedy rows, rows
without drafts and every accepted length in the batch: coupled verification slot by slot (sampling/coupled.py) for
point-mass drafts under rejection and any drafts under target_match, and the rejection rule for modelled drafts in
numpy (sampling/host_rejection.py), in float32 and float64; each applies exactly where it should."""

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


def _inputs(seed: int, with_q: bool, dtype: torch.dtype = torch.float32) -> VerifyInput:
    g = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(BATCH, SLOTS + 1, VOCAB, generator=g) * 2, dim=-1).to(dtype)
    seeds = torch.randint(0, 2**62, (BATCH,), generator=g)
    positions = torch.randint(0, 1000, (BATCH,), generator=g)
    own = torch.stack([sample_torch(target[:, j], seeds, positions + j, Purpose.SAMPLE) for j in range(SLOTS)], 1)
    other = torch.randint(0, VOCAB, (BATCH, SLOTS), generator=g)
    drafts = torch.where(torch.rand(BATCH, SLOTS, generator=g) < MATCH_SHARE, own, other)
    num_drafts = torch.randint(0, SLOTS + 1, (BATCH,), generator=g)
    drafts = torch.where(torch.arange(SLOTS) < num_drafts.unsqueeze(1), drafts, PAD_TOKEN)
    # q near p, so that modelled drafts are often accepted too
    noise = torch.randn(BATCH, SLOTS, VOCAB, generator=g)
    q = torch.softmax(target[:, :SLOTS].float().log() + noise, dim=-1) if with_q else None
    return VerifyInput(
        target_probs=target, draft_tokens=drafts, num_drafts=num_drafts, draft_probs=q,
        greedy=torch.rand(BATCH, generator=g) < 0.25, seeds=seeds, positions=positions,
    )


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("strategy, with_q", [("rejection", False), ("target_match", False), ("target_match", True)])
def test_slot_by_slot_equals_verify_torch(seed: int, strategy: str, with_q: bool) -> None:
    inp = _inputs(seed, with_q)
    assert is_coupled(inp, "normal", strategy)
    expected, got = verify_torch(inp, "normal", strategy), verify_coupled(inp)
    assert torch.equal(got.num_accepted, expected.num_accepted)
    assert torch.equal(got.output_tokens, expected.output_tokens)
    assert torch.equal(got.num_emitted, expected.num_emitted) and torch.equal(got.offsets, expected.offsets)
    assert set(got.num_accepted.tolist()) == set(range(SLOTS + 1))  # every accepted length was exercised


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_host_rejection_rule_equals_verify_torch(seed: int, dtype: torch.dtype) -> None:
    inp = _inputs(seed, True, dtype)
    assert is_host_rejection(inp, "normal", "rejection")
    expected, got = verify_torch(inp, "normal", "rejection"), verify_host_rejection(inp)
    assert torch.equal(got.num_accepted, expected.num_accepted)
    assert torch.equal(got.output_tokens, expected.output_tokens)
    assert torch.equal(got.num_emitted, expected.num_emitted) and torch.equal(got.offsets, expected.offsets)
    assert set(got.num_accepted.tolist()) == set(range(SLOTS + 1))


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
