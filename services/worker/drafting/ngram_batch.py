"""Batched prompt lookup over a padded token matrix: NgramProposer's contract for a whole batch at once, as tensors.

On CUDA tensors `ngram_propose` runs the Triton kernel of kernels/ngram.py (imported inside it, so CPU callers
never import triton); `ngram_propose_torch`, NgramProposer applied row by row on the host, is its twin. No engine
path calls it yet: the proposer drafts on host token lists.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels import use_kernel
from kernels.constants import PAD_TOKEN
from services.worker.drafting.ngram import NgramProposer


def ngram_propose_torch(
    tokens: Tensor, lengths: Tensor, num_drafts: Tensor, k: int, max_ngram_size: int, min_ngram_size: int
) -> tuple[Tensor, Tensor]:
    """`ngram_propose` computed by NgramProposer, one row at a time on the host."""
    batch = tokens.shape[0]
    if lengths.shape != (batch,) or num_drafts.shape != (batch,):
        raise ValueError(f"lengths {tuple(lengths.shape)} and num_drafts {tuple(num_drafts.shape)} must be [B]")
    proposer = NgramProposer(max_ngram_size, min_ngram_size)
    drafts = torch.full((batch, k), PAD_TOKEN, dtype=torch.int64)
    counts = torch.zeros(batch, dtype=torch.int64)
    for b, (row, length, wanted) in enumerate(zip(tokens.tolist(), lengths.tolist(), num_drafts.tolist())):
        proposal = proposer.propose(row[:length], min(wanted, k))
        drafts[b, : len(proposal)] = torch.tensor(proposal, dtype=torch.int64)
        counts[b] = len(proposal)
    return drafts.to(tokens.device), counts.to(tokens.device)


def ngram_propose(
    tokens: Tensor, lengths: Tensor, num_drafts: Tensor, k: int, max_ngram_size: int, min_ngram_size: int
) -> tuple[Tensor, Tensor]:
    """Up to min(num_drafts[b], k) drafts per row b of tokens [B, L] int64, whose first lengths[b] entries are its
    sequence: (drafts [B, k] int64, PAD_TOKEN past counts; counts [B] int64). The kernel on CUDA, the twin elsewhere.
    """
    if use_kernel(tokens):
        from kernels.ngram import ngram_propose_launch

        return ngram_propose_launch(tokens, lengths, num_drafts, k, max_ngram_size, min_ngram_size)
    return ngram_propose_torch(tokens, lengths, num_drafts, k, max_ngram_size, min_ngram_size)
