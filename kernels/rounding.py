"""Device casts that round alike on the GPU and in Triton's interpreter.

A GPU rounds a float32 -> bfloat16 conversion to nearest even, as torch does; Triton's interpreter truncates it
(it drops the low mantissa bits, whatever rounding is asked for). The model-op kernels round where Hugging Face's
eager code rounds, and their interpreter tests check that against the twins, so under the interpreter the
rounding is done on the bits: add half an ulp (minus one, plus the kept lowest bit, which ties to even), clear
the dropped bits, and the truncating cast that follows is exact.
"""

from __future__ import annotations

import triton
import triton.language as tl

BFLOAT16_SHIFT = tl.constexpr(16)  # bfloat16 is float32's upper 16 bits
HALF_ULP_BELOW = tl.constexpr((1 << 15) - 1)  # half a bfloat16 ulp in float32's dropped bits, less one
KEPT_BITS = tl.constexpr(0xFFFF0000)


@triton.jit
def cast(x, DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """x.to(DTYPE), rounded to nearest even; INTERPRETED: the kernel runs in Triton's interpreter (CPU tensors)."""
    if INTERPRETED and DTYPE == tl.bfloat16 and x.dtype != tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + HALF_ULP_BELOW + ((bits >> BFLOAT16_SHIFT) & 1)) & KEPT_BITS
        return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
    return x.to(DTYPE)
