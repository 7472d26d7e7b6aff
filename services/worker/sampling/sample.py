"""Turning logits into a sampling distribution, and sampling from it with counter-based noise.

Sampling is the exponential race: argmax_i p_i / E_i with E_i = -log(u_i) independent Exp(1) draws picks i with
probability p_i. Unlike inverse-CDF sampling it needs no cumulative sum, so the result does not depend on float
summation order, and with u from `random.uniform` it is a pure function of (p, seed, position, purpose): a request
gets the same tokens alone or in any batch.

On CUDA tensors `sample` runs the Triton kernel of kernels/sampling.py; `sample_torch` is its twin. The kernel
module is imported inside `sample`, so CPU callers never import triton.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import use_kernel
from services.worker.sampling.random import Purpose, host_keys, host_uniform_into, uniform

GREEDY_TEMPERATURE = 0.0  # rows with this temperature take the argmax
TOP_K_OFF = 0
TOP_P_OFF = 1.0  # top_p at or above this keeps the whole vocabulary
RACE_CHUNK_BYTES = 512 * 1024  # CPU race: each of its three buffers (8-byte entries) this large, all within a core's L2


def _truncation_mask(scaled: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """True where top-k, then top-p on the renormalised top-k distribution, drops a token."""
    vocab = scaled.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    k = torch.where(top_k > TOP_K_OFF, top_k.clamp(max=vocab), vocab)
    # Cut by value, as vLLM does: every token tied with the k-th survives, so which of them do cannot depend on the
    # order an unstable sort left them in.
    kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
    drop_sorted = sorted_logits < kth
    sorted_probs = torch.softmax(sorted_logits.masked_fill(drop_sorted, float("-inf")), dim=-1)
    # A token is needed while the mass strictly above it is still short of top_p: that is the smallest set
    # reaching top_p. Rows with top_p off skip this, so float error in the cumsum cannot trim their tail.
    mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
    top_p_on = (top_p < TOP_P_OFF).unsqueeze(1)
    drop_sorted |= top_p_on & (mass_above >= top_p.unsqueeze(1))
    drop_sorted[:, 0] = False  # the top token survives any top_p, however small
    return torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted)


def process_logits(
    logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor | None = None
) -> Tensor:
    """Probabilities [N, V] after temperature, min-p (None: no row asks), top-k (0 = off) and top-p, in vLLM's order;
    temperature 0 rows are one-hot (greedy).

    The sort behind top-k/top-p and the one-hot rows are made only when some row needs them, read in one host copy
    (which syncs with the device): most batches that sample have no greedy row, and then four vocabulary-wide ops
    per call were spent on nothing.
    """
    logits = logits.float()
    greedy = temperature == GREEDY_TEMPERATURE
    safe_temperature = torch.where(greedy, torch.ones_like(temperature), temperature).to(logits.dtype)
    scaled = logits / safe_temperature.unsqueeze(1)
    if min_p is not None:
        # p < min_p * max p, in logits: scaled < max scaled + log(min_p); log(0) = -inf keeps every token.
        floor = scaled.amax(dim=-1, keepdim=True) + torch.log(min_p.to(scaled.dtype)).unsqueeze(1)
        scaled = scaled.masked_fill(scaled < floor, float("-inf"))
    truncating, any_greedy = torch.stack(((top_k > TOP_K_OFF) | (top_p < TOP_P_OFF), greedy)).any(dim=1).tolist()
    if truncating:
        scaled = scaled.masked_fill(_truncation_mask(scaled, top_k, top_p), float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if not any_greedy:
        return probs
    one_hot = F.one_hot(logits.argmax(dim=-1), logits.shape[-1]).to(probs.dtype)
    return torch.where(greedy.unsqueeze(1), one_hot, probs)


def sample(probs: Tensor, seeds: Tensor, positions: Tensor, purpose: Purpose = Purpose.SAMPLE) -> Tensor:
    """One token id per row [N] int64, by the exponential race with noise keyed by (seed, position, purpose).

    A one-hot row yields its hot index. Tokens with probability 0 are never chosen. Rows need not sum to 1:
    the race picks i with probability probs_i / sum(probs). Exact ties go to the lowest id.
    """
    if use_kernel(probs):
        from kernels.sampling import sample_launch

        return sample_launch(probs, seeds, positions, purpose)
    return sample_torch(probs, seeds, positions, purpose)


def sample_torch(probs: Tensor, seeds: Tensor, positions: Tensor, purpose: Purpose = Purpose.SAMPLE) -> Tensor:
    """`sample` in torch ops, on any device: the reference the kernel is tested against."""
    if probs.device.type == "cpu":
        return _race_in_chunks(probs, seeds, positions, purpose)
    u = uniform(seeds, positions, purpose, width=probs.shape[-1])
    exponential = -torch.log(u)
    return (probs.to(torch.float64) / exponential).argmax(dim=-1)


def _race_in_chunks(probs: Tensor, seeds: Tensor, positions: Tensor, purpose: Purpose) -> Tensor:
    """The same race on the CPU, a chunk of rows at a time in reused buffers (RACE_CHUNK_BYTES each: 16 rows of a
    4,096-token vocabulary), with the same numbers bit for bit: the noise hashed in numpy (host_uniform_into), its
    log and the copy of p in torch's own ops, the rest in numpy over the same memory.
    The race over a whole batch streams [rows, vocab] int64 and float64 temporaries through memory some fifteen
    times; a chunk's stay in cache (128 verify rows of 4,096 tokens, one thread: 12.5 -> 4.1 ms). numpy's calls
    cost a fraction of torch's dispatch, which dominated the one to eight rows a decode step samples (one row:
    117 -> 85 us)."""
    rows, vocab = probs.shape
    chunk = max(min(rows, RACE_CHUNK_BYTES // (8 * vocab)), 1)
    stream, scratch = np.empty((chunk, vocab), dtype=np.uint64), np.empty((chunk, vocab), dtype=np.uint64)
    race = np.empty((chunk, vocab), dtype=np.float64)
    keys = host_keys(seeds, positions, purpose)
    chosen = np.empty(rows, dtype=np.int64)
    for start in range(0, rows, chunk):
        stop = min(start + chunk, rows)
        n = stop - start
        exponential = host_uniform_into(keys[start:stop], race[:n], stream[:n], scratch[:n])
        torch.from_numpy(exponential).log_().neg_()  # torch's log, as the twin on every other device takes it
        ratio = stream[:n].view(np.float64)  # the stream is spent: reuse it for p / E
        torch.from_numpy(ratio).copy_(probs[start:stop])  # exact from float32 and bfloat16, a chunk at a time
        ratio /= exponential
        chosen[start:stop] = ratio.argmax(axis=-1)
    return torch.from_numpy(chosen)
