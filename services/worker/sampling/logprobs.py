"""The logprob arrays of frame records: chosen token in slot 0, the top-K after it, and the chosen token's rank."""

from __future__ import annotations

import torch
from torch import Tensor

from kernels import use_kernel
from shared.frames import NO_TOKEN


def token_logprobs(logits: Tensor, chosen: Tensor, top_k: int) -> tuple[Tensor, Tensor, Tensor]:
    """(ids [N, top_k+1] int32, logprobs [N, top_k+1] float32, ranks [N] int32) under log_softmax(logits).

    Logprobs are of the raw model logits, before temperature or truncation, as the OpenAI API reports them.
    Rank is 1 + the number of tokens with a strictly higher logit (the same order as the logprobs, without their
    rounding), so a token tied with others gets the best rank of its tie group. Top-K is taken over the logits
    too; the order of exactly tied logits inside it is torch.topk's here and lowest id first in the kernel.
    On CUDA tensors this runs the Triton kernel of kernels/logprobs.py (imported here, so CPU callers never import
    triton); `token_logprobs_torch` is its twin.
    """
    if use_kernel(logits):
        from kernels.logprobs import token_logprobs_launch

        return token_logprobs_launch(logits, chosen, top_k)
    return token_logprobs_torch(logits, chosen, top_k)


def token_logprobs_torch(logits: Tensor, chosen: Tensor, top_k: int) -> tuple[Tensor, Tensor, Tensor]:
    """`token_logprobs` in torch ops, on any device: the reference the kernel is tested against."""
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen_logprob = logprobs.gather(1, chosen.unsqueeze(1))
    top_ids = logits.topk(top_k, dim=-1).indices
    ids = torch.cat([chosen.unsqueeze(1), top_ids], dim=1).to(torch.int32)
    values = torch.cat([chosen_logprob, logprobs.gather(1, top_ids)], dim=1)
    ranks = ((logits > logits.gather(1, chosen.unsqueeze(1))).sum(dim=-1) + 1).to(torch.int32)
    return ids, values, ranks


def with_named_tokens(
    logits: Tensor, arrays: tuple[Tensor, Tensor, Tensor], named: list[tuple[slice, tuple[int, ...]]]
) -> tuple[Tensor, Tensor, Tensor]:
    """`token_logprobs`' arrays where each (rows, tokens) pair has those tokens' logprobs in slots 1.. instead of
    the top-K (vLLM's logprob_token_ids), in the order named, and its other slots empty. Slot 0 and the rank are
    the chosen token's as before. The frames carry the named tokens like top-K ones: a frame's top_k is at least
    each request's count."""
    ids, values, ranks = arrays
    for rows, tokens in named:
        wanted = torch.tensor(tokens, device=logits.device)
        ids[rows, 1:] = NO_TOKEN
        values[rows, 1:] = -torch.inf
        ids[rows, 1 : 1 + len(tokens)] = wanted.to(ids.dtype)
        values[rows, 1 : 1 + len(tokens)] = torch.log_softmax(logits[rows].float(), dim=-1)[:, wanted]
    return ids, values, ranks
