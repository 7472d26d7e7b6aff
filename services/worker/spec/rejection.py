"""Verification of drafts against the target model by the lossless rejection rule, vectorised over the batch.

With p the target distribution and q the draft distribution at a position, draft x is accepted with probability
min(1, p(x)/q(x)). At the first rejection the emitted token is drawn from the residual max(p - q, 0), normalised;
if every draft is accepted, a bonus token is drawn from p at the position after the last draft. Each emitted
token is then distributed exactly as p, whatever q is.

Noise: the acceptance test of draft j uses uniform(seed, position + j, ACCEPT); the recovered or bonus token
uses sample(..., seed, position + num_accepted, SAMPLE), the same noise plain decoding draws for the token it
emits at that position. So a row with no drafts emits exactly the token plain decoding would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

from services.worker.spec.random import Purpose, uniform
from services.worker.spec.sampling import sample

PAD_TOKEN = -1  # fills draft_tokens past num_drafts and output_tokens past num_emitted
AcceptPolicy = Literal["normal", "accept_all", "reject_all"]
ACCEPT_POLICIES: tuple[str, ...] = get_args(AcceptPolicy)


@dataclass
class VerifyInput:
    target_probs: Tensor  # [B, K+1, V]: row j is p at positions + j given drafts[:j]; rows past num_drafts unused
    draft_tokens: Tensor  # [B, K] int64, PAD_TOKEN past num_drafts
    num_drafts: Tensor  # [B] int64 in 0..K
    draft_probs: Tensor | None  # [B, K, V] q, or None for point-mass proposals (q(x) = 1 at the drafted token)
    greedy: Tensor  # [B] bool: accept while draft == argmax p, then emit argmax p
    seeds: Tensor  # [B] int64
    positions: Tensor  # [B] int64: output position of the first token emitted this step


@dataclass
class VerifyOutput:
    num_accepted: Tensor  # [B] int64
    output_tokens: Tensor  # [B, K+1] int64: accepted drafts, then the recovered or bonus token, then PAD_TOKEN
    num_emitted: Tensor  # [B] int64 = num_accepted + 1


def _check_shapes(inp: VerifyInput) -> None:
    batch, num_slots = inp.draft_tokens.shape
    if inp.target_probs.dim() != 3 or inp.target_probs.shape[:2] != (batch, num_slots + 1):
        raise ValueError(
            f"target_probs {tuple(inp.target_probs.shape)} must be [B, K+1, V] for draft_tokens {(batch, num_slots)}"
        )
    if inp.draft_probs is not None and inp.draft_probs.shape != (batch, num_slots, inp.target_probs.shape[2]):
        raise ValueError(f"draft_probs {tuple(inp.draft_probs.shape)} must be [B, K, V] = {(batch, num_slots)}+[V]")
    for name in ("num_drafts", "greedy", "seeds", "positions"):
        if getattr(inp, name).shape != (batch,):
            raise ValueError(f"{name} {tuple(getattr(inp, name).shape)} must be [B] = ({batch},)")


def _accepted(inp: VerifyInput, has_draft: Tensor, accept_policy: AcceptPolicy) -> Tensor:
    """[B, K] bool: whether each draft passes its own test (a prefix of these is what counts)."""
    if accept_policy == "accept_all":
        return has_draft
    if accept_policy == "reject_all":
        return torch.zeros_like(has_draft)
    batch, num_slots = inp.draft_tokens.shape
    drafted = inp.draft_tokens.clamp(min=0).unsqueeze(-1)
    target_at_draft = inp.target_probs[:, :num_slots].gather(-1, drafted).squeeze(-1)
    if inp.draft_probs is None:
        draft_at_draft = torch.ones_like(target_at_draft)
    else:
        draft_at_draft = inp.draft_probs.gather(-1, drafted).squeeze(-1).to(target_at_draft.dtype)
    offsets = torch.arange(num_slots, device=inp.positions.device)
    u = uniform(
        inp.seeds.repeat_interleave(num_slots),
        (inp.positions.unsqueeze(1) + offsets).reshape(-1),
        Purpose.ACCEPT,
    ).reshape(batch, num_slots)
    # u < p/q without dividing: exact when q(x) = 0, and p(x) = 0 is never accepted since u > 0.
    stochastic = u * draft_at_draft < target_at_draft
    greedy = inp.draft_tokens == inp.target_probs[:, :num_slots].argmax(dim=-1)
    return has_draft & torch.where(inp.greedy.unsqueeze(1), greedy, stochastic)


def _residual(target: Tensor, draft: Tensor | None, drafted: Tensor) -> Tensor:
    """max(p - q, 0) normalised, for rows whose draft was rejected; p where the residual has no mass.

    Exact arithmetic never rejects a draft when p == q, but float rounding may leave the residual all zero.
    """
    if draft is None:
        residual = target.scatter(1, drafted.clamp(min=0).unsqueeze(1), 0.0)
    else:
        residual = (target - draft.to(target.dtype)).clamp(min=0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(mass.dtype).tiny), target)


def verify(inp: VerifyInput, accept_policy: AcceptPolicy = "normal") -> VerifyOutput:
    """Accepted prefix and emitted tokens for each row.

    accept_policy is for debugging: accept_all takes every draft (lossy), reject_all takes none and draws the
    emitted token from p itself, so its output equals plain decoding.
    """
    if accept_policy not in ACCEPT_POLICIES:
        raise ValueError(f"accept_policy must be one of {ACCEPT_POLICIES}, got {accept_policy!r}")
    _check_shapes(inp)
    batch, num_slots = inp.draft_tokens.shape
    device = inp.draft_tokens.device
    slots = torch.arange(num_slots, device=device).unsqueeze(0)
    has_draft = slots < inp.num_drafts.unsqueeze(1)
    accepted = _accepted(inp, has_draft, accept_policy)
    num_accepted = accepted.to(torch.int64).cumprod(dim=1).sum(dim=1)

    rows = torch.arange(batch, device=device)
    target_next = inp.target_probs[rows, num_accepted]  # p at the position of the token emitted after the prefix
    rejected = (num_accepted < inp.num_drafts) & (accept_policy == "normal")
    emit_dist = target_next
    if num_slots > 0:
        rejected_slot = num_accepted.clamp(max=num_slots - 1)
        draft = None if inp.draft_probs is None else inp.draft_probs[rows, rejected_slot]
        residual = _residual(target_next, draft, inp.draft_tokens[rows, rejected_slot])
        emit_dist = torch.where(rejected.unsqueeze(1), residual, target_next)
    emitted = sample(emit_dist, inp.seeds, inp.positions + num_accepted, Purpose.SAMPLE)
    emitted = torch.where(inp.greedy, target_next.argmax(dim=-1), emitted)

    output_tokens = torch.full((batch, num_slots + 1), PAD_TOKEN, dtype=torch.int64, device=device)
    output_tokens[:, :num_slots] = torch.where(slots < num_accepted.unsqueeze(1), inp.draft_tokens, PAD_TOKEN)
    output_tokens.scatter_(1, num_accepted.unsqueeze(1), emitted.unsqueeze(1))
    return VerifyOutput(num_accepted=num_accepted, output_tokens=output_tokens, num_emitted=num_accepted + 1)
