"""Row reductions shared by the sampling and verification kernels: the exponential race and the argmax.

Both scan a vocabulary row in BLOCK-sized chunks and break ties towards the lowest id, like torch.argmax.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.noise import uniform_at

RACE_PLAIN = tl.constexpr(0)  # race over p
RACE_RESIDUAL = tl.constexpr(1)  # race over max(p - q, 0): the rejection rule's residual
RACE_POINT_MASS = tl.constexpr(2)  # race over p with the drafted token removed: the residual of a point-mass q
NO_RATIO = tl.constexpr(-1.0)  # below every real ratio p / E (p >= 0), so masked lanes never win


@triton.jit
def race(p_row, q_row, drafted, vocab, key, MODE: tl.constexpr, BLOCK: tl.constexpr):
    """(argmax_i w_i / -log(u_i), the winning ratio) with w picked by MODE and u = uniform_at(key, i).

    w is computed in p's dtype and then widened to float64, as the torch twin does, so the ratios are equal bit
    for bit; the winning ratio is 0 exactly when w has no mass.
    """
    best_ratio = tl.full((), -1.0, tl.float64)
    best_index = tl.full((), 0, tl.int64)
    for start in range(0, vocab, BLOCK):
        index = start + tl.arange(0, BLOCK)
        inside = index < vocab
        weight = tl.load(p_row + index, mask=inside, other=0.0)
        if MODE == RACE_RESIDUAL:
            q = tl.load(q_row + index, mask=inside, other=0.0).to(weight.dtype)
            weight = tl.maximum(weight - q, 0.0)
        elif MODE == RACE_POINT_MASS:
            weight = tl.where(index == drafted, 0.0, weight)
        ratio = weight.to(tl.float64) / -tl.log(uniform_at(key, index))
        ratio = tl.where(inside, ratio, NO_RATIO)
        block_ratio, block_index = tl.max(ratio, axis=0, return_indices=True, return_indices_tie_break_left=True)
        better = block_ratio > best_ratio  # strict: an equal ratio in a later block loses, as in torch.argmax
        best_index = tl.where(better, start + block_index.to(tl.int64), best_index)
        best_ratio = tl.where(better, block_ratio, best_ratio)
    return best_index, best_ratio


@triton.jit
def argmax(p_row, vocab, BLOCK: tl.constexpr):
    """The lowest id of the largest entry of a row."""
    best_value = tl.full((), float("-inf"), tl.float64)
    best_index = tl.full((), 0, tl.int64)
    for start in range(0, vocab, BLOCK):
        index = start + tl.arange(0, BLOCK)
        inside = index < vocab
        value = tl.load(p_row + index, mask=inside, other=float("-inf")).to(tl.float64)
        block_value, block_index = tl.max(value, axis=0, return_indices=True, return_indices_tie_break_left=True)
        better = block_value > best_value
        best_index = tl.where(better, start + block_index.to(tl.int64), best_index)
        best_value = tl.where(better, block_value, best_value)
    return best_index
