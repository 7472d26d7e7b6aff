"""Verification of drafts against the target model, vectorised over the batch, under four strategies.

rejection (lossless): draft x is accepted with probability min(1, p(x)/q(x)), p the target distribution and q the
  draft distribution at its position (a point mass at x when no q is given). At the first rejection the emitted
  token is drawn from the residual max(p - q, 0); if every draft is accepted, a bonus token is drawn from p at the
  position after the last draft. Each emitted token is then distributed exactly as p, whatever q is.
  A point-mass draft (q(x) = 1: ngram, suffix) takes the test in its coupled form: x is accepted iff it equals
  the target's own sample at that position, which happens with probability p(x) = min(1, p(x)/q(x)); after a
  rejection the residual sample is that same target sample. So for point-mass drafts the output does not depend
  on what was drafted, and a seeded request reproduces whatever the suffix cache or the batch proposed.
target_match (lossless): draft j is accepted iff it equals the token the target samples at its position with the
  noise plain decoding draws there, sample(p_j, seed, position + j, SAMPLE); the token after the accepted prefix is
  the target's own sample. With the same seed this emits exactly the tokens plain decoding emits, whatever the
  drafter and the number of drafts; only the number of steps changes.
greedy (lossy for sampled rows): draft j is accepted while it equals argmax p_j; after the prefix a sampled row
  samples from p (SAMPLE noise), a greedy row takes argmax p.
topp (lossy): draft j is accepted while it lies inside the nucleus of p_j: the tokens whose strictly more likely
  tokens hold less than top_p of the mass (tokens tied at the boundary are all inside). After the prefix: a sample
  from p. top_p is per row (VerifyInput.top_p).

Greedy rows (temperature 0) follow the greedy rule under every strategy: accept while draft == argmax p, emit
argmax p. That is also what target_match amounts to for them, since their p is one-hot.

Noise: the rejection test of draft j uses uniform(seed, position + j, ACCEPT); every emitted token that is drawn
uses sample(..., seed, position + num_accepted, SAMPLE), the noise plain decoding draws for the token it emits at
that position, so a row with no drafts emits exactly the token plain decoding would.

On CUDA tensors `verify` runs the fused Triton kernel of kernels/verify.py through `verify_fused`, which imports
it (so CPU callers never import triton); `verify_torch` is its twin. On the CPU, with verify_torch's results bit for
bit: coupled verification (point-mass drafts, target_match) runs slot by slot in sampling/coupled.py, and the
rejection rule for modelled drafts in numpy in sampling/host_rejection.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

from kernels import use_kernel
from kernels.constants import ACCEPT_POLICY_CODES, PAD_TOKEN, VERIFY_STRATEGY_CODES
from services.worker.sampling.random import Purpose, uniform
from services.worker.sampling.sample import sample_torch

AcceptPolicy = Literal["normal", "accept_all", "reject_all"]
ACCEPT_POLICIES: tuple[str, ...] = get_args(AcceptPolicy)
VerifyStrategy = Literal["rejection", "target_match", "greedy", "topp"]
VERIFY_STRATEGIES: tuple[str, ...] = get_args(VerifyStrategy)


@dataclass
class VerifyInput:
    target_probs: Tensor  # [B, K+1, V]: row j is p at positions + j given drafts[:j]; rows past num_drafts unused
    draft_tokens: Tensor  # [B, K] int64, PAD_TOKEN past num_drafts
    num_drafts: Tensor  # [B] int64 in 0..K
    draft_probs: Tensor | None  # [B, K, V] q, or None for point-mass proposals (q(x) = 1 at the drafted token)
    greedy: Tensor  # [B] bool: accept while draft == argmax p, then emit argmax p
    seeds: Tensor  # [B] int64
    positions: Tensor  # [B] int64: output position of the first token emitted this step
    top_p: Tensor | None = None  # [B] float: the nucleus of the "topp" strategy (required by it, unused otherwise)


@dataclass
class VerifyOutput:
    num_accepted: Tensor  # [B] int64
    output_tokens: Tensor  # [B, K+1] int64: accepted drafts, then the recovered or bonus token, then PAD_TOKEN
    num_emitted: Tensor  # [B] int64 = num_accepted + 1
    offsets: Tensor  # [B] int64: exclusive cumulative sum of num_emitted (where each row's tokens start, packed)

    @classmethod
    def of(cls, num_accepted: Tensor, output_tokens: Tensor) -> VerifyOutput:
        """The output of these accepted counts and tokens, its emitted counts and offsets derived from them."""
        num_emitted = num_accepted + 1
        return cls(num_accepted, output_tokens, num_emitted, num_emitted.cumsum(dim=0) - num_emitted)


def check_verify_args(inp: VerifyInput, accept_policy: str, verify_strategy: str) -> None:
    """Raises ValueError for an unknown policy or strategy, a missing top_p, or inconsistent shapes."""
    if accept_policy not in ACCEPT_POLICIES:
        raise ValueError(f"accept_policy must be one of {ACCEPT_POLICIES}, got {accept_policy!r}")
    if verify_strategy not in VERIFY_STRATEGIES:
        raise ValueError(f"verify_strategy must be one of {VERIFY_STRATEGIES}, got {verify_strategy!r}")
    if verify_strategy == "topp" and inp.top_p is None:
        raise ValueError('verify_strategy "topp" needs VerifyInput.top_p')
    batch, num_slots = inp.draft_tokens.shape
    if inp.target_probs.dim() != 3 or inp.target_probs.shape[:2] != (batch, num_slots + 1):
        raise ValueError(
            f"target_probs {tuple(inp.target_probs.shape)} must be [B, K+1, V] for draft_tokens {(batch, num_slots)}"
        )
    if inp.draft_probs is not None and inp.draft_probs.shape != (batch, num_slots, inp.target_probs.shape[2]):
        raise ValueError(f"draft_probs {tuple(inp.draft_probs.shape)} must be [B, K, V] = {(batch, num_slots)}+[V]")
    for name in ("num_drafts", "greedy", "seeds", "positions", "top_p"):
        value = getattr(inp, name)
        if value is not None and value.shape != (batch,):
            raise ValueError(f"{name} {tuple(value.shape)} must be [B] = ({batch},)")


def _slot_coordinates(inp: VerifyInput, num_slots: int) -> tuple[Tensor, Tensor]:
    """Seeds and positions [B * K] of every draft slot, row-major."""
    offsets = torch.arange(num_slots, device=inp.positions.device)
    return inp.seeds.repeat_interleave(num_slots), (inp.positions.unsqueeze(1) + offsets).reshape(-1)


def _rejection_test(
    inp: VerifyInput, drafted: Tensor, slot_probs: Tensor, target_at_draft: Tensor, tested: Tensor
) -> Tensor:
    batch, num_slots = drafted.shape
    if inp.draft_probs is None:
        return _target_match_test(inp, slot_probs, tested)  # every draft is a point mass
    draft_at_draft = inp.draft_probs.gather(-1, drafted.unsqueeze(-1)).squeeze(-1).to(target_at_draft.dtype)
    u = uniform(*_slot_coordinates(inp, num_slots), Purpose.ACCEPT).reshape(batch, num_slots)
    # u < p/q without dividing: exact when q(x) = 0, and p(x) = 0 is never accepted since u > 0.
    test = u * draft_at_draft < target_at_draft
    point_mass = draft_at_draft >= 1.0
    if bool(point_mass.any()):
        test = torch.where(point_mass, _target_match_test(inp, slot_probs, tested & point_mass), test)
    return test


def _target_match_test(inp: VerifyInput, slot_probs: Tensor, tested: Tensor) -> Tensor:
    """[B, K] whether each slot's sample from p is its draft. Only the `tested` slots count (the others are masked
    by the caller): on the CPU only those are sampled, since a sample's noise spans the vocabulary and a batch's
    empty and greedy slots would cost as much as its drafts. Elsewhere every slot is, so as never to wait on the
    device for the mask."""
    batch, num_slots, vocab = slot_probs.shape
    seeds, positions = _slot_coordinates(inp, num_slots)
    drafts = inp.draft_tokens.reshape(-1)
    if slot_probs.device.type != "cpu":
        samples = sample_torch(slot_probs.reshape(-1, vocab), seeds, positions, Purpose.SAMPLE)
        return (drafts == samples).view(batch, num_slots)
    rows = tested.reshape(-1).nonzero().squeeze(1)
    matched = torch.zeros(batch * num_slots, dtype=torch.bool)
    # slot_probs[tested] picks the same rows, in the same order, without copying the untested ones first.
    samples = sample_torch(slot_probs[tested], seeds[rows], positions[rows], Purpose.SAMPLE)
    matched[rows] = drafts[rows] == samples
    return matched.view(batch, num_slots)


def _topp_test(inp: VerifyInput, slot_probs: Tensor, target_at_draft: Tensor) -> Tensor:
    # float64 sums so that the boundary decision depends as little as possible on summation order.
    probs = slot_probs.to(torch.float64)
    at_draft = target_at_draft.to(torch.float64).unsqueeze(-1)
    mass_above = torch.where(probs > at_draft, probs, 0.0).sum(dim=-1)
    return (target_at_draft > 0) & (mass_above < inp.top_p.to(torch.float64).unsqueeze(1))


def _accepted(inp: VerifyInput, has_draft: Tensor, accept_policy: str, verify_strategy: str) -> Tensor:
    """[B, K] bool: whether each draft passes its own test (a prefix of these is what counts)."""
    if accept_policy == "accept_all":
        return has_draft
    if accept_policy == "reject_all":
        return torch.zeros_like(has_draft)
    num_slots = inp.draft_tokens.shape[1]
    slot_probs = inp.target_probs[:, :num_slots]
    drafted = inp.draft_tokens.clamp(min=0)
    target_at_draft = slot_probs.gather(-1, drafted.unsqueeze(-1)).squeeze(-1)
    greedy = inp.draft_tokens == slot_probs.argmax(dim=-1)
    tested = has_draft & ~inp.greedy.unsqueeze(1)  # the slots whose sampled test is read below
    if verify_strategy == "rejection":
        test = _rejection_test(inp, drafted, slot_probs, target_at_draft, tested)
    elif verify_strategy == "target_match":
        test = _target_match_test(inp, slot_probs, tested)
    elif verify_strategy == "greedy":
        test = greedy
    else:
        test = _topp_test(inp, slot_probs, target_at_draft)
    return has_draft & torch.where(inp.greedy.unsqueeze(1), greedy, test)


def _residual(target: Tensor, draft: Tensor | None, drafted: Tensor) -> Tensor:
    """max(p - q, 0), unnormalised (the exponential race is scale-free), for rows whose draft was rejected;
    p where the residual has no mass.

    Exact arithmetic never rejects a draft when p == q, but float rounding may leave the residual all zero.
    Leaving it unnormalised keeps every entry an elementwise function of p and q, so the fused kernel
    reproduces it bit for bit without depending on a summation order.
    """
    if draft is None:
        residual = target.scatter(1, drafted.clamp(min=0).unsqueeze(1), 0.0)
    else:
        residual = (target - draft.to(target.dtype)).clamp(min=0.0)
    has_mass = residual.amax(dim=-1, keepdim=True) > 0
    return torch.where(has_mass, residual, target)


def verify_torch(
    inp: VerifyInput, accept_policy: AcceptPolicy = "normal", verify_strategy: VerifyStrategy = "rejection"
) -> VerifyOutput:
    """`verify` in torch ops, on any device: the reference the fused kernel is tested against."""
    check_verify_args(inp, accept_policy, verify_strategy)
    batch, num_slots = inp.draft_tokens.shape
    device = inp.draft_tokens.device
    slots = torch.arange(num_slots, device=device).unsqueeze(0)
    has_draft = slots < inp.num_drafts.unsqueeze(1)
    accepted = _accepted(inp, has_draft, accept_policy, verify_strategy)
    num_accepted = accepted.to(torch.int64).cumprod(dim=1).sum(dim=1)

    rows = torch.arange(batch, device=device)
    target_next = inp.target_probs[rows, num_accepted]  # p at the position of the token emitted after the prefix
    emit_dist = target_next
    if num_slots > 0 and verify_strategy == "rejection" and accept_policy == "normal":
        rejected = num_accepted < inp.num_drafts
        rejected_slot = num_accepted.clamp(max=num_slots - 1)
        draft = None if inp.draft_probs is None else inp.draft_probs[rows, rejected_slot]
        residual = _residual(target_next, draft, inp.draft_tokens[rows, rejected_slot])
        emit_dist = torch.where(rejected.unsqueeze(1), residual, target_next)
    emitted = sample_torch(emit_dist, inp.seeds, inp.positions + num_accepted, Purpose.SAMPLE)
    emitted = torch.where(inp.greedy, target_next.argmax(dim=-1), emitted)

    output_tokens = torch.full((batch, num_slots + 1), PAD_TOKEN, dtype=torch.int64, device=device)
    output_tokens[:, :num_slots] = torch.where(slots < num_accepted.unsqueeze(1), inp.draft_tokens, PAD_TOKEN)
    output_tokens.scatter_(1, num_accepted.unsqueeze(1), emitted.unsqueeze(1))
    return VerifyOutput.of(num_accepted, output_tokens)


def verify_fused(
    inp: VerifyInput, accept_policy: AcceptPolicy = "normal", verify_strategy: VerifyStrategy = "rejection"
) -> VerifyOutput:
    """`verify` on the fused kernel of kernels/verify.py: CUDA tensors, or CPU tensors under TRITON_INTERPRET=1."""
    check_verify_args(inp, accept_policy, verify_strategy)
    from kernels.verify import verify_launch

    num_accepted, output_tokens, offsets = verify_launch(
        inp.target_probs,
        inp.draft_tokens,
        inp.num_drafts,
        inp.draft_probs,
        inp.greedy,
        inp.seeds,
        inp.positions,
        inp.top_p,
        strategy=VERIFY_STRATEGY_CODES[verify_strategy],
        policy=ACCEPT_POLICY_CODES[accept_policy],
    )
    return VerifyOutput(
        num_accepted=num_accepted, output_tokens=output_tokens, num_emitted=num_accepted + 1, offsets=offsets
    )


def verify(
    inp: VerifyInput, accept_policy: AcceptPolicy = "normal", verify_strategy: VerifyStrategy = "rejection"
) -> VerifyOutput:
    """Accepted prefix and emitted tokens for each row (see the module docstring for the strategies).

    accept_policy is for debugging: accept_all takes every draft (lossy), reject_all takes none and draws the
    emitted token from p itself, so its output equals plain decoding.
    """
    if use_kernel(inp.target_probs):
        return verify_fused(inp, accept_policy, verify_strategy)
    # Both build on this module.
    from services.worker.sampling.coupled import is_coupled, verify_coupled
    from services.worker.sampling.host_rejection import is_host_rejection, verify_host_rejection

    result = None
    if is_coupled(inp, accept_policy, verify_strategy):
        result = verify_coupled(inp)
    elif is_host_rejection(inp, accept_policy, verify_strategy):
        result = verify_host_rejection(inp)
    return result if result is not None else verify_torch(inp, accept_policy, verify_strategy)
