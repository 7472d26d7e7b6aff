"""Batched prompt lookup: for each row of a padded token matrix, the tokens that followed the most recent earlier
occurrence of the row's longest recurring suffix (max_ngram_size down to min_ngram_size tokens).
Twin: services/worker/drafting/ngram_batch.ngram_propose_torch, NgramProposer applied row by row (same match,
same drafts).

Layout: one program per row. Every earlier position e holding the row's last token is a candidate end; a block
of candidates grows its matches backwards for up to MAX_NGRAM tokens at once (a static loop), and the best
candidate is the largest (match length, e) pair, packed into one int64 so a single max finds the longest match
and, among equals, the most recent one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.constants import PAD_TOKEN

BLOCK = 256
NUM_WARPS = 4
PAD = tl.constexpr(PAD_TOKEN)
NO_CANDIDATE = tl.constexpr(-1)
BEFORE_START = tl.constexpr(PAD_TOKEN - 1)


@triton.jit
def _ngram_kernel(tokens_ptr, lengths_ptr, num_drafts_ptr, drafts_ptr, counts_ptr, width, out_width, min_ngram,
                  MAX_NGRAM: tl.constexpr, BLOCK: tl.constexpr, OUT_BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    row_tokens = tokens_ptr + row * width
    length = tl.load(lengths_ptr + row)
    last = length - 1
    longest_possible = tl.minimum(length - 1, MAX_NGRAM)  # an earlier occurrence ends by length - 2

    best = tl.full((), NO_CANDIDATE, tl.int64)  # match_length * width + end of the best candidate
    for start in range(0, width, BLOCK):
        ends = start + tl.arange(0, BLOCK).to(tl.int64)
        still = ends < last
        match_length = tl.zeros((BLOCK,), tl.int64)
        for back in tl.static_range(MAX_NGRAM):
            # Past the longest possible match the tail reads as PAD and a token before the row's start as
            # BEFORE_START: neither equals a real token nor the other, so the match stops there.
            tail = tl.load(row_tokens + last - back, mask=back < longest_possible, other=PAD)
            here = tl.load(row_tokens + ends - back, mask=still & (ends >= back), other=BEFORE_START)
            still = still & (here == tail)
            match_length += still.to(tl.int64)
        score = tl.where(match_length > 0, match_length * width + ends, NO_CANDIDATE)
        best = tl.maximum(best, tl.max(score, axis=0))

    longest = tl.where(best >= 0, best // width, 0)
    end = best % width
    wanted = tl.load(num_drafts_ptr + row)
    count = tl.where(longest >= min_ngram, tl.minimum(wanted, last - end), 0)
    count = tl.maximum(count, 0)
    slots = tl.arange(0, OUT_BLOCK)
    drafted = tl.load(row_tokens + end + 1 + slots, mask=slots < count, other=PAD)
    tl.store(drafts_ptr + row * out_width + slots, drafted, mask=slots < out_width)
    tl.store(counts_ptr + row, count)


def ngram_propose_launch(
    tokens: Tensor, lengths: Tensor, num_drafts: Tensor, k: int, max_ngram_size: int, min_ngram_size: int
) -> tuple[Tensor, Tensor]:
    """Launches the kernel (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1).

    tokens [B, L] int64 (row b's first lengths[b] entries are its sequence), num_drafts [B]: at most this many
    drafts per row (rows are capped by k too). Returns (drafts [B, k] int64, PAD_TOKEN past counts; counts [B]).
    """
    assert tokens.dim() == 2, f"tokens must be [B, L], got {tuple(tokens.shape)}"
    batch, width = tokens.shape
    assert lengths.shape == (batch,) and num_drafts.shape == (batch,), "lengths and num_drafts must be [B]"
    assert tokens.dtype == torch.int64, f"tokens must be int64, got {tokens.dtype}"
    assert 1 <= min_ngram_size <= max_ngram_size, (min_ngram_size, max_ngram_size)
    assert batch == 0 or int(lengths.max()) <= width, "a length exceeds the token matrix's width"
    drafts = torch.full((batch, k), PAD_TOKEN, dtype=torch.int64, device=tokens.device)
    counts = torch.zeros(batch, dtype=torch.int64, device=tokens.device)
    if batch > 0 and width > 0:
        _ngram_kernel[(batch,)](
            tokens.contiguous(),
            lengths.to(torch.int64).contiguous(),
            num_drafts.to(torch.int64).clamp(max=k).contiguous(),
            drafts,
            counts,
            width,
            k,
            min_ngram_size,
            MAX_NGRAM=max_ngram_size,
            BLOCK=BLOCK,
            OUT_BLOCK=triton.next_power_of_2(max(k, 1)),
            num_warps=NUM_WARPS,
        )
    return drafts, counts

