"""Verification of a batch whose rows are all greedy: accept while the draft is the target's argmax, then emit
the argmax. No noise, no probabilities: the rule every strategy applies to temperature-0 rows, at the cost of
one argmax over the logits."""

from __future__ import annotations

import torch
from torch import Tensor

from services.worker.sampling.rejection import PAD_TOKEN


def greedy_verify(logits: Tensor, draft_tokens: Tensor, num_drafts: Tensor) -> tuple[Tensor, Tensor]:
    """logits [B, K+1, V] (row j scores the token after draft j), draft_tokens [B, K], num_drafts [B] ->
    (output_tokens [B, K+1] with PAD_TOKEN past the emitted ones, num_accepted [B])."""
    target = logits.argmax(dim=-1)  # [B, K+1]
    num_slots = draft_tokens.shape[1]
    slots = torch.arange(num_slots + 1, device=logits.device)
    match = (draft_tokens == target[:, :num_slots]) & (slots[:num_slots] < num_drafts[:, None])
    num_accepted = match.to(torch.int64).cumprod(dim=1).sum(dim=1)
    # An accepted draft equals the argmax at its slot, so the emitted tokens are the argmaxes up to the bonus.
    output = torch.where(slots <= num_accepted[:, None], target, PAD_TOKEN)
    return output, num_accepted
