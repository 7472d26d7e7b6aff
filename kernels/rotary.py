"""Rotary position embedding applied in place, half-split layout (Hugging Face's Llama and Qwen2): with x1 and x2
the first and second halves of a head, x1 becomes x1 cos - x2 sin and x2 becomes x2 cos + x1 sin.
Twin: services/worker/model/rotary_apply.apply_rotary_torch (equal: the same float32 products and sums).

Layout: one program per token, all of its heads in one tile: q and k of a fused qkv projection are adjacent heads
of one strided [T, heads + kv_heads, head_dim] view, so one launch rotates both where they lie, and each
token's cos and sin ([2, head_dim / 2], float32) are loaded once for every head.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from kernels.rounding import cast

PAIR_AXIS = 2  # cos_sin [T, 2, head_dim / 2]: cos at index 0, sin at index 1 of that axis
NUM_WARPS = 4


@triton.jit
def _rotary_kernel(
    x_ptr,  # [T, heads, head_dim], head_dim contiguous; rotated in place
    cos_sin_ptr,  # [T, 2, HALF], contiguous
    num_heads,
    stride_x_token,
    stride_x_head,
    HALF: tl.constexpr,
    HALF_PADDED: tl.constexpr,  # HALF rounded up to a power of two
    HEADS_PADDED: tl.constexpr,
    INTERPRETED: tl.constexpr,  # CPU tensors in Triton's interpreter: bfloat16 rounding done on the bits
):
    token = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, HALF_PADDED)
    heads = tl.arange(0, HEADS_PADDED)
    dim_inside = dims < HALF
    table = cos_sin_ptr + token * (2 * HALF)
    cos = tl.load(table + dims, mask=dim_inside, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(table + HALF + dims, mask=dim_inside, other=0.0).to(tl.float32)[None, :]
    inside = (heads < num_heads)[:, None] & dim_inside[None, :]
    first = x_ptr + token * stride_x_token + heads[:, None] * stride_x_head + dims[None, :]  # [HEADS, HALF]
    x1 = tl.load(first, mask=inside, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=inside, other=0.0).to(tl.float32)
    tl.store(first, cast(x1 * cos - x2 * sin, x_ptr.dtype.element_ty, INTERPRETED), mask=inside)
    tl.store(first + HALF, cast(x2 * cos + x1 * sin, x_ptr.dtype.element_ty, INTERPRETED), mask=inside)


def rotary_launch(x: Tensor, cos_sin: Tensor) -> Tensor:
    """Rotates x [..., heads, head_dim] in place by cos_sin [..., 2, head_dim / 2] (the same leading dims) and
    returns x. Launches the kernel (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1)."""
    assert x.dim() >= 2, f"x must be [..., heads, head_dim], got {tuple(x.shape)}"
    num_heads, head_dim = x.shape[-2:]
    assert head_dim % 2 == 0, f"head_dim {head_dim} must be even: the halves rotate as pairs"
    half = head_dim // 2
    assert cos_sin.shape == (*x.shape[:-2], PAIR_AXIS, half), (
        f"cos_sin {tuple(cos_sin.shape)} must be [..., 2, head_dim / 2] = {(*x.shape[:-2], PAIR_AXIS, half)}"
    )
    assert cos_sin.is_floating_point(), f"cos_sin must be floating point, got {cos_sin.dtype}"
    assert x.stride(-1) == 1, "x's head_dim must be contiguous"
    # A view, never a copy: the rotation is written back where x lies (a [T, ...] slice of a fused projection
    # flattens to a view; a layout that cannot is refused here).
    tokens = x.view(-1, num_heads, head_dim)  # [T, heads, head_dim]
    table = cos_sin.reshape(-1, PAIR_AXIS, half).contiguous()  # [T, 2, head_dim / 2]
    if tokens.shape[0] > 0 and num_heads > 0:
        _rotary_kernel[(tokens.shape[0],)](
            tokens,
            table,
            num_heads,
            tokens.stride(0),
            tokens.stride(1),
            HALF=half,
            HALF_PADDED=triton.next_power_of_2(half),
            HEADS_PADDED=triton.next_power_of_2(num_heads),
            INTERPRETED=x.device.type == "cpu",  # CPU tensors reach the kernel only under the interpreter
            num_warps=NUM_WARPS,
        )
    return x
