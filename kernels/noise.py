"""services/worker/sampling/random.py's counter-based uniforms inside Triton kernels, bit for bit.

The torch version works on int64 bit patterns (wrapping multiplication, masked shifts); here the same 64-bit
patterns are uint64, whose shifts are logical and whose multiplication wraps, so each step is the same function.
Both take their constants from kernels/constants.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.constants import GOLDEN_GAMMA, MIX_MUL_1, MIX_MUL_2, UNIFORM_BITS

GOLDEN = tl.constexpr(GOLDEN_GAMMA)
MUL_1 = tl.constexpr(MIX_MUL_1)
MUL_2 = tl.constexpr(MIX_MUL_2)
DROP_BITS = tl.constexpr(64 - UNIFORM_BITS)
UNIFORM_SCALE = tl.constexpr(2.0**-UNIFORM_BITS)


@triton.jit
def mix64(x):
    """splitmix64's finaliser on uint64."""
    x = (x ^ (x >> 30)) * MUL_1
    x = (x ^ (x >> 27)) * MUL_2
    return x ^ (x >> 31)


@triton.jit
def noise_key(seed, position, PURPOSE: tl.constexpr):
    """The uint64 key of (seed, position, purpose) for int64 scalars seed and position (random._key)."""
    key = mix64(seed.to(tl.uint64, bitcast=True) + GOLDEN)
    key = mix64(key ^ position.to(tl.uint64, bitcast=True))
    return mix64(key + tl.full((), PURPOSE, tl.uint64) * GOLDEN)


@triton.jit
def to_unit_interval(bits):
    return ((bits >> DROP_BITS).to(tl.float64) + 0.5) * UNIFORM_SCALE


@triton.jit
def uniform_scalar(key):
    """random.uniform(..., width=None) for one key: a float64 strictly inside (0, 1)."""
    return to_unit_interval(mix64(key + GOLDEN))


@triton.jit
def uniform_at(key, index):
    """Entry `index` (int tensor, 0-based) of random.uniform(..., width=W) for one key."""
    return to_unit_interval(mix64(key + (index + 1).to(tl.uint64) * GOLDEN))
