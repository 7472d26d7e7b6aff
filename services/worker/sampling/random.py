"""Counter-based randomness: every random number is a pure function of (request seed, token position, purpose).

Why not a torch.Generator per request: a stateful stream makes a token depend on how many numbers were drawn
before it, so batching, preemption, retries on another worker or a different number of drafts would change the
output. Hashing the coordinates instead gives the same number for the same token wherever and however it is
computed, and never touches the global torch RNG.

The hash is splitmix64's finaliser, chained over the coordinates, in int64 torch ops so it runs vectorised on any
device. Two int64 facts it relies on: multiplication wraps modulo 2**64, and `>>` is arithmetic, so a logical
shift masks off the copied sign bits.
"""

from __future__ import annotations

import enum

import torch
from torch import Tensor


class Purpose(enum.IntEnum):
    """What a random number is for: each purpose draws independent noise at the same (seed, position)."""

    SAMPLE = 1  # the token emitted at a position (plain decoding, and the bonus/recovered token of a verify step)
    ACCEPT = 2  # the acceptance test of the draft at a position
    RECOVER = 3  # reserved for a sampler that needs noise of its own after a rejection
    DRAFT = 4  # a draft model sampling its proposal for a position


def _to_int64(value: int) -> int:
    """The int64 with the same low 64 bits as a Python int (what int64 tensor arithmetic would give)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


GOLDEN_GAMMA = _to_int64(0x9E3779B97F4A7C15)  # splitmix64's stream increment (2**64 / golden ratio, odd)
MIX_MUL_1 = _to_int64(0xBF58476D1CE4E5B9)
MIX_MUL_2 = _to_int64(0x94D049BB133111EB)

UNIFORM_BITS = 52  # a float64 holds 52 bits below 1 exactly, so (k + 0.5) / 2**52 is never 0 and never rounds to 1
_UNIFORM_SCALE = 2.0**-UNIFORM_BITS


def _shift_right(x: Tensor, bits: int) -> Tensor:
    """Logical right shift of int64 bit patterns."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64(x: Tensor) -> Tensor:
    """splitmix64's finaliser on int64 tensors: a bijection of 64-bit patterns with good avalanche."""
    x = (x ^ _shift_right(x, 30)) * MIX_MUL_1
    x = (x ^ _shift_right(x, 27)) * MIX_MUL_2
    return x ^ _shift_right(x, 31)


def _key(seeds: Tensor, positions: Tensor, purpose: Purpose) -> Tensor:
    """One 64-bit key per (seed, position, purpose). Each stage is a bijection of the coordinate it adds."""
    key = mix64(seeds + GOLDEN_GAMMA)
    key = mix64(key ^ positions)
    return mix64(key + _to_int64(int(purpose) * GOLDEN_GAMMA))


def _to_unit_interval(bits: Tensor) -> Tensor:
    return (_shift_right(bits, 64 - UNIFORM_BITS).to(torch.float64) + 0.5) * _UNIFORM_SCALE


def uniform(seeds: Tensor, positions: Tensor, purpose: Purpose, width: int | None = None) -> Tensor:
    """Uniform float64 numbers strictly inside (0, 1): [B] when width is None, else [B, width].

    With a width, row b is the first `width` numbers of the splitmix64 stream keyed by
    (seeds[b], positions[b], purpose): one per vocabulary entry for exponential-race sampling.
    """
    if seeds.shape != positions.shape or seeds.dim() != 1:
        raise ValueError(f"seeds {tuple(seeds.shape)} and positions {tuple(positions.shape)} must be equal 1-d shapes")
    if seeds.dtype != torch.int64 or positions.dtype != torch.int64:
        raise TypeError(f"seeds and positions must be int64, got {seeds.dtype} and {positions.dtype}")
    key = _key(seeds, positions, purpose)
    if width is None:
        return _to_unit_interval(mix64(key + GOLDEN_GAMMA))
    counters = torch.arange(1, width + 1, dtype=torch.int64, device=seeds.device) * GOLDEN_GAMMA
    return _to_unit_interval(mix64(key.unsqueeze(1) + counters))
