"""What proposers hand the engine: per sequence a Draft (drafted tokens and the distribution q they came from),
and per step a DraftBatch, the padded tensors that scoring and verification read."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from services.worker.sampling.rejection import PAD_TOKEN


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


@dataclass
class DraftBatch:
    """One step's drafts for the whole batch, as verification reads them."""

    drafts: list[Draft]
    tokens: Tensor  # [B, K] int64, PAD_TOKEN past each row's count
    counts: Tensor  # [B] int64
    q: Tensor | None  # [B, K, vocab], or None when every draft is a point mass
    host_counts: np.ndarray  # [B] the counts on the host
    num_tokens: int  # drafted tokens in all

    @property
    def width(self) -> int:
        """K: the most drafts any row has (0 when the step drafts nothing)."""
        return self.tokens.shape[1]

    @classmethod
    def build(cls, drafts: list[Draft], vocab_size: int, device: torch.device) -> "DraftBatch":
        lengths = [len(d.tokens) for d in drafts]
        counts = np.array(lengths, dtype=np.int64)
        if not any(lengths):  # plain decoding: nothing to pack, nothing to verify (a CPU step pays every op)
            return cls(
                drafts=drafts, tokens=torch.empty((len(drafts), 0), dtype=torch.int64, device=device),
                counts=torch.zeros(len(drafts), dtype=torch.int64, device=device), q=None, host_counts=counts,
                num_tokens=0,
            )
        width = max(lengths)
        tokens = np.full((len(drafts), width), PAD_TOKEN, dtype=np.int64)
        for b, draft in enumerate(drafts):
            tokens[b, : counts[b]] = draft.tokens
        both = torch.from_numpy(np.concatenate([tokens.reshape(-1), counts])).to(device)
        return cls(
            drafts=drafts,
            tokens=both[: tokens.size].view(tokens.shape),
            counts=both[tokens.size :],
            q=stack_probs(drafts, width, vocab_size, device),
            host_counts=counts,
            num_tokens=sum(lengths),
        )

    def modelled_rows(self, rows: list[int]) -> tuple[Tensor, Tensor] | None:
        """The reported logits [M, vocab] and drafted tokens [M] of the modelled drafts of these rows, one after
        another (row order, then draft order), for one logprobs call; None when they have none."""
        drafts = [self.drafts[b] for b in rows if self.drafts[b].num_modelled]
        if not drafts:
            return None
        logits = torch.cat([d.report_logits for d in drafts])
        tokens = torch.tensor([t for d in drafts for t in d.tokens[: d.num_modelled]], device=logits.device)
        return logits, tokens
