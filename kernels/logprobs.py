"""Frame logprobs: log-softmax, the chosen token's logprob and rank, and the top-K ids and logprobs of each row.
Twin: services/worker/sampling/logprobs.token_logprobs_torch (ids and ranks equal, logprobs within float32
rounding).

Layout: a row is cut into CHUNK-wide vocabulary chunks and each (row, chunk) is a program, so even one row spreads
over many SMs (75 programs at Qwen2.5's 151,936 ids). The launcher takes exactly the rows to report (e.g. the
emitted ones) and makes three launches, none of which reads the device on the host (graph-capturable):

1. stats, per chunk, in one read of it: its largest key (below), the sum of exp(logit - chunk max) and how many
   of its logits are above the chosen one's.
2. candidates, per chunk, only when top_k > 0: `larger` = how many of the row's chunks have a larger largest key.
   Each of those holds an element above every element of this chunk, so this chunk can hold at most
   top_k - larger of the row's top-K: a chunk with larger >= top_k stops after reading the row's chunk maxima, the
   others (at most top_k chunks of a row) read their chunk again and pull out their own top
   min(top_k - larger, CHUNK) keys, largest first, from registers.
3. merge, one program per row: the log-normaliser from the chunk maxima and sums, the rank from the counts, and
   top_k rounds of "largest candidate key below the previous one" over at most top_k * top_k candidates.

Key: the logit's bits mapped to an order-preserving uint32 in the high half of a uint64 and the complemented id in
the low half. Every key is distinct and exact ties come out lowest id first, so the top-K does not depend on how
the row is chunked; the logit is read back from the key's high half.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

CHUNK = 2048  # vocabulary entries per program: 16 per thread at NUM_WARPS
NUM_WARPS = 4
# The candidates and merge programs hold all of a row's chunk maxima in one tile.
MAX_CHUNKS = 1024
# Candidate keys the merge reads per step: the API's largest top_logprobs (20) gives a 20 x 20 grid, one tile.
MERGE_BLOCK = 512
# The candidate buffer is never empty, so even top_k = 0 passes the merge a real pointer.
MIN_CANDIDATES = 1
ID_BITS = tl.constexpr(32)
LOW_MASK = tl.constexpr((1 << 32) - 1)
SIGN_BIT = tl.constexpr(1 << 31)
ABOVE_EVERY_KEY = tl.constexpr((1 << 64) - 1)
# Below every real key: a real key's low half is 0 only for id 2^32 - 1, and ids are < 2^32 - 1.
NO_KEY = tl.constexpr(0)


@triton.jit
def _order_key(x, index):
    """A uint64 that orders (logit descending, id ascending) like an integer: larger key = earlier in top-K."""
    bits = x.to(tl.uint32, bitcast=True)
    ordered = tl.where((bits & SIGN_BIT) != 0, bits ^ LOW_MASK, bits | SIGN_BIT)
    return (ordered.to(tl.uint64) << ID_BITS) | (index.to(tl.uint64) ^ LOW_MASK)


@triton.jit
def _key_logit(key):
    """The float32 logit a key was made from (_order_key's high half, inverted)."""
    ordered = (key >> ID_BITS).to(tl.uint32)
    bits = tl.where((ordered & SIGN_BIT) != 0, ordered ^ SIGN_BIT, ordered ^ LOW_MASK)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _chunk_logits(logits_ptr, row, chunk, vocab, CHUNK: tl.constexpr):
    """(logits as float32, their keys) of one chunk; lanes past the vocabulary hold -inf and NO_KEY."""
    index = chunk * CHUNK + tl.arange(0, CHUNK)
    inside = index < vocab
    x = tl.load(logits_ptr + row * vocab + index, mask=inside, other=float("-inf")).to(tl.float32)  # [CHUNK]
    return x, tl.where(inside, _order_key(x, index), NO_KEY)


@triton.jit
def _chunk_stats_kernel(logits_ptr, chosen_ptr, max_keys_ptr, sums_ptr, above_ptr, vocab, chunks,
                        CHUNK: tl.constexpr):  # fmt: skip
    program = tl.program_id(0)  # = row * chunks + chunk: the stats' flat index
    row = (program // chunks).to(tl.int64)
    chosen_logit = tl.load(logits_ptr + row * vocab + tl.load(chosen_ptr + row)).to(tl.float32)
    x, keys = _chunk_logits(logits_ptr, row, program % chunks, vocab, CHUNK)
    max_key = tl.max(keys, axis=0)
    chunk_max = _key_logit(max_key)
    # A chunk of only -inf sums exp(-inf - 0) = 0 rather than exp(-inf - -inf) = NaN.
    shift = tl.where(chunk_max == float("-inf"), 0.0, chunk_max)
    tl.store(max_keys_ptr + program, max_key.to(tl.int64, bitcast=True))
    tl.store(sums_ptr + program, tl.sum(tl.exp(x - shift), axis=0))
    tl.store(above_ptr + program, tl.sum((x > chosen_logit).to(tl.int32), axis=0))


@triton.jit
def _chunk_candidates_kernel(logits_ptr, max_keys_ptr, candidates_ptr, vocab, chunks, top_k, candidate_ranks, slots,
                             CHUNK: tl.constexpr, CHUNKS_PAD: tl.constexpr):  # fmt: skip
    program = tl.program_id(0)
    row = (program // chunks).to(tl.int64)
    chunk_index = tl.arange(0, CHUNKS_PAD)
    row_max_keys = tl.load(max_keys_ptr + row * chunks + chunk_index, mask=chunk_index < chunks, other=NO_KEY)
    own_max_key = tl.load(max_keys_ptr + program).to(tl.uint64, bitcast=True)
    larger = tl.sum((row_max_keys.to(tl.uint64, bitcast=True) > own_max_key).to(tl.int32), axis=0)
    if larger < top_k:
        _, keys = _chunk_logits(logits_ptr, row, program % chunks, vocab, CHUNK)
        # Candidates are [rows, candidate_ranks, slots]: this chunk's list goes to its rank among the row's chunks.
        out = candidates_ptr + (row * candidate_ranks + larger) * slots
        for slot in range(tl.minimum(top_k - larger, slots)):
            best = tl.max(keys, axis=0)
            tl.store(out + slot, best.to(tl.int64, bitcast=True))
            keys = tl.where(keys == best, NO_KEY, keys)


@triton.jit
def _merge_kernel(logits_ptr, chosen_ptr, max_keys_ptr, sums_ptr, above_ptr, candidates_ptr, ids_ptr, logprobs_ptr,
                  ranks_ptr, vocab, chunks, top_k, candidate_ranks, slots, CHUNKS_PAD: tl.constexpr,
                  MERGE_BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.arange(0, CHUNKS_PAD)
    present = chunk < chunks
    stats = row * chunks + chunk
    max_keys = tl.load(max_keys_ptr + stats, mask=present, other=NO_KEY).to(tl.uint64, bitcast=True)  # [CHUNKS_PAD]
    chunk_max = tl.where(present, _key_logit(max_keys), float("-inf"))
    row_max = _key_logit(tl.max(max_keys, axis=0))
    # Each chunk summed exp(x - its own max); an all -inf chunk (sum 0) gets scale 0, never 0 * exp(0 - row_max).
    scale = tl.where(chunk_max == float("-inf"), 0.0, tl.exp(chunk_max - row_max))
    sums = tl.load(sums_ptr + stats, mask=present, other=0.0)
    log_sum = tl.log(tl.sum(sums * scale, axis=0))
    above = tl.sum(tl.load(above_ptr + stats, mask=present, other=0), axis=0)

    chosen = tl.load(chosen_ptr + row)
    chosen_logit = tl.load(logits_ptr + row * vocab + chosen).to(tl.float32)
    out_row = row * (top_k + 1)
    tl.store(ids_ptr + out_row, chosen.to(tl.int32))
    tl.store(logprobs_ptr + out_row, (chosen_logit - row_max) - log_sum)
    tl.store(ranks_ptr + row, above + 1)

    row_candidates = candidates_ptr + row * candidate_ranks * slots
    previous = tl.full((), ABOVE_EVERY_KEY, tl.uint64)
    for slot in range(1, top_k + 1):
        best = tl.full((), NO_KEY, tl.uint64)
        for start in range(0, candidate_ranks * slots, MERGE_BLOCK):
            flat = start + tl.arange(0, MERGE_BLOCK)
            # The chunk of rank r wrote min(top_k - r, slots) keys; the rest of its slots were never written.
            written = (flat < candidate_ranks * slots) & (flat % slots < top_k - flat // slots)
            keys = tl.load(row_candidates + flat, mask=written, other=NO_KEY).to(tl.uint64, bitcast=True)
            best = tl.maximum(best, tl.max(tl.where(keys < previous, keys, NO_KEY), axis=0))
        previous = best
        tl.store(ids_ptr + out_row + slot, ((best & LOW_MASK) ^ LOW_MASK).to(tl.int32))
        tl.store(logprobs_ptr + out_row + slot, (_key_logit(best) - row_max) - log_sum)


def token_logprobs_launch(
    logits: Tensor, chosen: Tensor, top_k: int, chunk: int = CHUNK
) -> tuple[Tensor, Tensor, Tensor]:
    """Launches the kernels (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1) over every row given.

    `chunk` (a power of two) is the vocabulary entries per program; tests pass small ones to get many chunks out
    of a small vocabulary.
    """
    assert logits.dim() == 2, f"logits must be [N, V], got {tuple(logits.shape)}"
    rows, vocab = logits.shape
    assert chosen.shape == (rows,), f"chosen {tuple(chosen.shape)} must be [N] = ({rows},)"
    assert 0 <= top_k <= vocab, f"top_k {top_k} must be in 0..{vocab}"
    assert 0 < vocab < LOW_MASK, "ids are packed into 32 bits, with the all-ones id left for NO_KEY"
    assert chunk > 0 and chunk & (chunk - 1) == 0, f"chunk {chunk} must be a power of two"
    chunks = triton.cdiv(vocab, chunk)
    assert chunks <= MAX_CHUNKS, f"vocabulary {vocab} makes {chunks} chunks of {chunk}, over {MAX_CHUNKS}"
    ids = torch.empty(rows, top_k + 1, dtype=torch.int32, device=logits.device)
    logprobs = torch.empty(rows, top_k + 1, dtype=torch.float32, device=logits.device)
    ranks = torch.empty(rows, dtype=torch.int32, device=logits.device)
    if rows == 0:
        return ids, logprobs, ranks
    logits = logits.contiguous()
    chosen = chosen.to(torch.int64).contiguous()
    max_keys = torch.empty(rows, chunks, dtype=torch.int64, device=logits.device)  # uint64 keys' bits
    sums = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    above = torch.empty(rows, chunks, dtype=torch.int32, device=logits.device)
    # [rows, candidate ranks, slots]: the chunk whose maximum ranks r-th in its row fills slots 0..top_k - r - 1.
    candidate_ranks, slots = min(chunks, top_k), min(top_k, chunk)
    candidates = torch.empty(
        max(rows * candidate_ranks * slots, MIN_CANDIDATES), dtype=torch.int64, device=logits.device
    )
    chunks_pad = triton.next_power_of_2(chunks)
    grid = (rows * chunks,)
    _chunk_stats_kernel[grid](logits, chosen, max_keys, sums, above, vocab, chunks, CHUNK=chunk, num_warps=NUM_WARPS)
    if top_k > 0:
        _chunk_candidates_kernel[grid](
            logits, max_keys, candidates, vocab, chunks, top_k, candidate_ranks, slots,
            CHUNK=chunk, CHUNKS_PAD=chunks_pad, num_warps=NUM_WARPS,
        )  # fmt: skip
    _merge_kernel[(rows,)](
        logits, chosen, max_keys, sums, above, candidates, ids, logprobs, ranks, vocab, chunks, top_k,
        candidate_ranks, slots, CHUNKS_PAD=chunks_pad, MERGE_BLOCK=MERGE_BLOCK, num_warps=NUM_WARPS,
    )  # fmt: skip
    return ids, logprobs, ranks
