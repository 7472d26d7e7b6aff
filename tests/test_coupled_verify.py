"""sampling/coupled.py: coupled verification slot by slot on the CPU gives verify_torch's tokens and counts, bit for
bit, for point-mass drafts under rejection and for any drafts under target_match, with greedy rows, rows without
drafts and every accepted length in the batch; and `verify` takes it exactly where it applies."""

from __future__ import annotations

import pytest
import torch

from services.worker.sampling.coupled import is_coupled, verify_coupled
from services.worker.sampling.random import Purpose
from services.worker.sampling.rejection import PAD_TOKEN, VerifyInput, verify_torch
from services.worker.sampling.sample import sample_torch

BATCH, SLOTS, VOCAB = 48, 4, 300
MATCH_SHARE = 0.75  # drafts copy the target's own sample this often, so that long accepted prefixes occur


def _inputs(seed: int, with_q: bool) -> VerifyInput:
    g = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(BATCH, SLOTS + 1, VOCAB, generator=g) * 2, dim=-1)
    seeds = torch.randint(0, 2**62, (BATCH,), generator=g)
    positions = torch.randint(0, 1000, (BATCH,), generator=g)
    own = torch.stack([sample_torch(target[:, j], seeds, positions + j, Purpose.SAMPLE) for j in range(SLOTS)], 1)
    other = torch.randint(0, VOCAB, (BATCH, SLOTS), generator=g)
    drafts = torch.where(torch.rand(BATCH, SLOTS, generator=g) < MATCH_SHARE, own, other)
    num_drafts = torch.randint(0, SLOTS + 1, (BATCH,), generator=g)
    drafts = torch.where(torch.arange(SLOTS) < num_drafts.unsqueeze(1), drafts, PAD_TOKEN)
    q = torch.softmax(torch.randn(BATCH, SLOTS, VOCAB, generator=g), dim=-1) if with_q else None
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


def test_it_applies_to_coupled_tests_on_the_cpu_only() -> None:
    point_mass, with_q = _inputs(0, False), _inputs(0, True)
    assert not is_coupled(with_q, "normal", "rejection")  # u < p/q: one uniform a slot, already cheap
    assert not is_coupled(point_mass, "accept_all", "rejection")
    assert not is_coupled(point_mass, "normal", "greedy") and not is_coupled(point_mass, "normal", "topp")
