"""What a proposer hands the engine for one sequence and step: drafted tokens and the distribution q they came from."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from services.worker.sampling.logprobs import point_mass_logprobs, token_logprobs


@dataclass
class Draft:
    """tokens[j] is the proposal for the j-th token after the sequence's last one.

    probs: q rows [len(tokens), vocab], or None when every token is a point mass (q(x) = 1 at the token), as
    host-side proposers (n-gram, suffix) give. report_logits: rows [m, vocab] whose log_softmax is reported as
    the draft logprobs of the first m tokens; the tokens after them are reported as point masses.
    """

    tokens: list[int]
    probs: Tensor | None = None
    report_logits: Tensor | None = None

    def __post_init__(self) -> None:
        if self.probs is not None and self.probs.shape[0] != len(self.tokens):
            raise ValueError(f"{len(self.tokens)} tokens but {self.probs.shape[0]} q rows")
        if self.report_logits is not None and self.report_logits.shape[0] > len(self.tokens):
            raise ValueError(f"{len(self.tokens)} tokens but {self.report_logits.shape[0]} logprob rows")

    @property
    def num_modelled(self) -> int:
        """How many leading tokens have a model distribution to report (the rest are point masses)."""
        return 0 if self.report_logits is None else self.report_logits.shape[0]


    def logprobs(self, top_k: int) -> tuple[Tensor, Tensor, Tensor]:
        """Frame arrays (ids, logprobs, ranks) of the drafted tokens under the reported distributions."""
        tokens = torch.tensor(self.tokens, dtype=torch.long)
        parts = []
        if self.report_logits is not None and self.num_modelled:
            device = self.report_logits.device
            parts.append(token_logprobs(self.report_logits, tokens[: self.num_modelled].to(device), top_k))
        if len(tokens) > self.num_modelled:
            parts.append(point_mass_logprobs(tokens[self.num_modelled :], top_k))
        return tuple(torch.cat([p[i].cpu() for p in parts]) for i in range(3))


def point_mass_rows(tokens: list[int], vocab_size: int, device: torch.device) -> Tensor:
    """q rows [len(tokens), vocab] of point-mass proposals: one-hot at each token."""
    return F.one_hot(torch.tensor(tokens, dtype=torch.long, device=device), vocab_size).float()


def stack_probs(drafts: list[Draft], width: int, vocab_size: int, device: torch.device) -> Tensor | None:
    """q for verification [B, width, vocab], or None when every draft is a point mass (verify's fast path).

    Point-mass drafts in a batch with modelled ones get one-hot rows, which verify treats exactly as point
    masses: accept with probability p(x), residual p with x removed. Rows past a draft's length stay zero.
    """
    if all(d.probs is None for d in drafts):
        return None
    probs = torch.zeros(len(drafts), width, vocab_size, device=device)
    for b, draft in enumerate(drafts):
        if draft.probs is not None:
            probs[b, : len(draft.tokens)] = draft.probs
        elif draft.tokens:
            probs[b, : len(draft.tokens)] = point_mass_rows(draft.tokens, vocab_size, device)
    return probs
