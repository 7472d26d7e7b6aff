"""The fused verification kernel, run by Triton's interpreter on CPU tensors, against its torch twin: the same
num_accepted, output tokens and offsets for every strategy and policy, on ragged batches with greedy/sampled mixes.
"""

from __future__ import annotations

from tests.kernelfixture import single_thread  # noqa: F401  (first: it puts triton in interpreter mode)

import pytest
import torch

pytest.importorskip("triton")

from kernels.constants import ACCEPT_POLICY_CODES, VERIFY_STRATEGY_CODES  # noqa: E402
from kernels.verify import verify_launch  # noqa: E402
from services.worker.sampling.random import Purpose  # noqa: E402
from services.worker.sampling.rejection import (  # noqa: E402
    ACCEPT_POLICIES,
    PAD_TOKEN,
    VERIFY_STRATEGIES,
    VerifyInput,
    verify,
    verify_fused,
    verify_torch,
)
from services.worker.sampling.sample import sample_torch  # noqa: E402

BATCH = 6
FIELDS = ("num_accepted", "output_tokens", "num_emitted", "offsets")


def _ragged_input(num_slots: int, vocab: int, with_q: bool, seed: int) -> VerifyInput:
    """Rows with 0..K drafts; drafts from q, or the target's argmax or a random token (point masses)."""
    generator = torch.Generator().manual_seed(seed)
    logits = 2 * torch.randn(BATCH, num_slots + 1, vocab, generator=generator)
    target = torch.softmax(logits, dim=-1)
    seeds = torch.randint(0, 1 << 40, (BATCH,), generator=generator)
    positions = torch.randint(0, 500, (BATCH,), generator=generator)
    num_drafts = torch.arange(BATCH) % (num_slots + 1)
    draft_probs = None
    if with_q:
        draft_probs = torch.softmax(logits[:, :num_slots] + 2 * torch.randn(BATCH, num_slots, vocab), dim=-1)
        columns = [sample_torch(draft_probs[:, j], seeds, positions + j, Purpose.DRAFT) for j in range(num_slots)]
        drafts = torch.stack(columns, dim=1) if columns else torch.empty(BATCH, 0, dtype=torch.int64)
    else:
        random_tokens = torch.randint(0, vocab, (BATCH, num_slots), generator=generator)
        mostly_right = torch.rand(BATCH, num_slots, generator=generator) < 0.7
        drafts = torch.where(mostly_right, target[:, :num_slots].argmax(dim=-1), random_tokens)
    return VerifyInput(
        target_probs=target,
        draft_tokens=torch.where(torch.arange(num_slots) < num_drafts.unsqueeze(1), drafts, PAD_TOKEN),
        num_drafts=num_drafts,
        draft_probs=draft_probs,
        greedy=torch.arange(BATCH) % 3 == 1,
        seeds=seeds,
        positions=positions,
        top_p=torch.rand(BATCH, generator=generator, dtype=torch.float64) * 0.9 + 0.1,
    )


def _assert_same(inp: VerifyInput, policy: str, strategy: str) -> None:
    got, want = verify_fused(inp, policy, strategy), verify_torch(inp, policy, strategy)
    for field in FIELDS:
        assert torch.equal(getattr(got, field), getattr(want, field)), (field, policy, strategy)


@pytest.mark.parametrize("strategy", VERIFY_STRATEGIES)
@pytest.mark.parametrize(("num_slots", "vocab"), [(0, 97), (1, 1000), (3, 4099), (5, 97)])
def test_kernel_matches_twin_for_point_mass_drafts(strategy: str, num_slots: int, vocab: int) -> None:
    _assert_same(_ragged_input(num_slots, vocab, with_q=False, seed=num_slots), "normal", strategy)


@pytest.mark.parametrize("strategy", VERIFY_STRATEGIES)
def test_kernel_matches_twin_with_draft_probs(strategy: str) -> None:
    inp = _ragged_input(3, 1000, with_q=True, seed=11)
    _assert_same(inp, "normal", strategy)
    if strategy == "rejection":
        assert int(inp.num_drafts.sum() - verify_torch(inp).num_accepted.sum()) > 0  # rejections were exercised


@pytest.mark.parametrize("policy", ["accept_all", "reject_all"])
def test_kernel_matches_twin_under_debug_policies(policy: str) -> None:
    _assert_same(_ragged_input(2, 97, with_q=True, seed=5), policy, "rejection")
    _assert_same(_ragged_input(2, 97, with_q=False, seed=6), policy, "target_match")


def test_residual_without_mass_falls_back_to_p() -> None:
    # q == p: the draft has p(x) = 0, so it is always rejected, and the residual max(p - q, 0) is zero everywhere.
    p = torch.tensor([[[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]])
    inp = VerifyInput(
        target_probs=p,
        draft_tokens=torch.tensor([[2]]),
        num_drafts=torch.tensor([1]),
        draft_probs=p[:, :1].clone(),
        greedy=torch.tensor([False]),
        seeds=torch.tensor([3]),
        positions=torch.tensor([0]),
    )
    _assert_same(inp, "normal", "rejection")


def test_a_single_row_and_the_dispatcher_on_cpu() -> None:
    inp = _ragged_input(2, 97, with_q=False, seed=8)
    alone = VerifyInput(**{name: value[2:3] if value is not None else None for name, value in vars(inp).items()})
    _assert_same(alone, "normal", "target_match")
    assert torch.equal(verify(inp).output_tokens, verify_torch(inp).output_tokens)


def test_every_strategy_and_policy_has_a_kernel_code_and_the_launcher_checks_shapes() -> None:
    assert set(VERIFY_STRATEGY_CODES) == set(VERIFY_STRATEGIES)
    assert set(ACCEPT_POLICY_CODES) == set(ACCEPT_POLICIES)
    inp = _ragged_input(2, 97, with_q=False, seed=9)
    tensors = (inp.target_probs, inp.draft_tokens, inp.num_drafts, None, inp.greedy, inp.seeds, inp.positions, None)
    codes = {"strategy": VERIFY_STRATEGY_CODES["rejection"], "policy": ACCEPT_POLICY_CODES["normal"]}
    with pytest.raises(AssertionError, match="seeds"):
        verify_launch(*tensors[:5], inp.seeds[:1], *tensors[6:], **codes)
    with pytest.raises(AssertionError, match="int64"):
        verify_launch(*tensors[:5], inp.seeds.to(torch.int32), *tensors[6:], **codes)
    with pytest.raises(AssertionError, match="top_p"):
        verify_launch(*tensors, strategy=VERIFY_STRATEGY_CODES["topp"], policy=ACCEPT_POLICY_CODES["normal"])
