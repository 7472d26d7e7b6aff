"""Frame logprobs: log-softmax, the chosen token's logprob and rank, and the top-K ids and logprobs of each row.
Twin: services/worker/sampling/logprobs.token_logprobs_torch (ids and ranks equal, logprobs within float32
rounding).

Layout: one program per row (the launcher takes exactly the rows to report, e.g. the emitted ones). Pass 1 streams
the row once for the online max and sum of exponentials and the count of logits above the chosen one. Top-K then
takes K passes, each finding the largest (logit, lowest id) key below the previous one: the logit's bits mapped to
an order-preserving uint32 in the high half of a uint64 and the complemented id in the low half, so every key is
distinct and exact ties come out lowest id first. K is small (the API caps top_logprobs at 20); a row that is
re-read from L2 K times costs less than a sort of the vocabulary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 1024
NUM_WARPS = 4
ID_BITS = tl.constexpr(32)
LOW_MASK = tl.constexpr((1 << 32) - 1)
SIGN_BIT = tl.constexpr(1 << 31)
ABOVE_EVERY_KEY = tl.constexpr((1 << 64) - 1)


@triton.jit
def _order_key(x, index):
    """A uint64 that orders (logit descending, id ascending) like an integer: larger key = earlier in top-K."""
    bits = x.to(tl.uint32, bitcast=True)
    ordered = tl.where((bits & SIGN_BIT) != 0, bits ^ LOW_MASK, bits | SIGN_BIT)
    return (ordered.to(tl.uint64) << ID_BITS) | (index.to(tl.uint64) ^ LOW_MASK)


@triton.jit
def _logprobs_kernel(logits_ptr, chosen_ptr, ids_ptr, logprobs_ptr, ranks_ptr, vocab, top_k, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = logits_ptr + row * vocab
    chosen = tl.load(chosen_ptr + row)
    chosen_logit = tl.load(x_row + chosen).to(tl.float32)

    running_max = tl.full((), float("-inf"), tl.float32)
    running_sum = tl.full((), 0.0, tl.float32)
    above = tl.full((), 0, tl.int32)
    for start in range(0, vocab, BLOCK):
        index = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + index, mask=index < vocab, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        # Until a finite logit shows up the shift is 0, not -inf: -inf - -inf would make the sum NaN when a row's
        # first blocks are all masked.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        running_sum = running_sum * tl.exp(running_max - shift) + tl.sum(tl.exp(x - shift), axis=0)
        running_max = new_max
        above += tl.sum((x > chosen_logit).to(tl.int32), axis=0)
    log_sum = tl.log(running_sum)

    out_row = row * (top_k + 1)
    tl.store(ids_ptr + out_row, chosen.to(tl.int32))
    tl.store(logprobs_ptr + out_row, (chosen_logit - running_max) - log_sum)
    tl.store(ranks_ptr + row, above + 1)

    previous = tl.full((), ABOVE_EVERY_KEY, tl.uint64)
    for slot in range(1, top_k + 1):
        best = tl.full((), 0, tl.uint64)
        for start in range(0, vocab, BLOCK):
            index = start + tl.arange(0, BLOCK)
            inside = index < vocab
            x = tl.load(x_row + index, mask=inside, other=float("-inf")).to(tl.float32)
            key = _order_key(x, index)
            best = tl.maximum(best, tl.max(tl.where(inside & (key < previous), key, 0), axis=0))
        previous = best
        token = ((best & LOW_MASK) ^ LOW_MASK).to(tl.int64)
        logit = tl.load(x_row + token).to(tl.float32)
        tl.store(ids_ptr + out_row + slot, token.to(tl.int32))
        tl.store(logprobs_ptr + out_row + slot, (logit - running_max) - log_sum)


def token_logprobs_launch(logits: Tensor, chosen: Tensor, top_k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Launches the kernel (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1) over every row given."""
    assert logits.dim() == 2, f"logits must be [N, V], got {tuple(logits.shape)}"
    rows, vocab = logits.shape
    assert chosen.shape == (rows,), f"chosen {tuple(chosen.shape)} must be [N] = ({rows},)"
    assert 0 <= top_k <= vocab, f"top_k {top_k} must be in 0..{vocab}"
    assert vocab < 1 << 32, "ids are packed into 32 bits"
    ids = torch.empty(rows, top_k + 1, dtype=torch.int32, device=logits.device)
    logprobs = torch.empty(rows, top_k + 1, dtype=torch.float32, device=logits.device)
    ranks = torch.empty(rows, dtype=torch.int32, device=logits.device)
    if rows > 0:
        _logprobs_kernel[(rows,)](
            logits.contiguous(),
            chosen.to(torch.int64).contiguous(),
            ids,
            logprobs,
            ranks,
            vocab,
            top_k,
            BLOCK=BLOCK,
            num_warps=NUM_WARPS,
        )
    return ids, logprobs, ranks

