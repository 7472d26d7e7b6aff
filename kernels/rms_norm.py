"""RMSNorm fused with the residual add: one read of x (and the residual), one write of the normed row (and the new
residual). Twin: services/worker/model/rms_norm.rms_norm_torch (equal up to the float32 sum's order).

Layout: one program per row, the whole row in one tile (hidden sizes of served models are at most a few
thousand). The sum x + residual is rounded to the model dtype (it is the residual stream the next layer adds to,
as torch's add in that dtype stores it), the mean of squares accumulates in float32, the normalised row is cast
to the model dtype and only then scaled by the weight, the product rounded once: Hugging Face's order, so
bfloat16 rows round where its eager code rounds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.rounding import cast

MAX_HIDDEN = 16384  # one row is one tile: 64 KiB of float32 registers across the program's warps
ELEMENTS_PER_WARP = 256  # the tile is spread so each thread holds at most ~8 elements
MAX_WARPS = 16


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [rows, hidden], hidden contiguous
    residual_ptr,  # [rows, hidden] or unused
    weight_ptr,  # [hidden]
    out_ptr,  # [rows, hidden], contiguous
    new_residual_ptr,  # [rows, hidden], contiguous, or unused
    hidden,
    eps,
    stride_x,
    stride_residual,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,  # hidden rounded up to a power of two
    INTERPRETED: tl.constexpr,  # CPU tensors in Triton's interpreter: bfloat16 rounding done on the bits
):
    dtype = out_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=inside, other=0.0)
        x = cast(x.to(tl.float32) + residual.to(tl.float32), dtype, INTERPRETED)
        tl.store(new_residual_ptr + row * hidden + cols, x, mask=inside)
    xf = x.to(tl.float32)
    inverse_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    normed = cast(xf * inverse_rms, dtype, INTERPRETED).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, cast(normed * weight, dtype, INTERPRETED), mask=inside)


def rms_norm_launch(
    x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
) -> Tensor | tuple[Tensor, Tensor]:
    """norm(x) [..., hidden], or with a residual (norm(x + residual), x + residual), in x's dtype. Launches the
    kernel (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1); the twin's contract."""
    assert x.dim() >= 1, "x must be [..., hidden]"
    hidden = x.shape[-1]
    assert 0 < hidden <= MAX_HIDDEN, f"hidden {hidden} must be in 1..{MAX_HIDDEN}: a row is one tile"
    assert weight.shape == (hidden,), f"weight {tuple(weight.shape)} must be [hidden] = ({hidden},)"
    assert weight.dtype == x.dtype, f"weight {weight.dtype} and x {x.dtype} must share the model dtype"
    if residual is not None:
        assert residual.shape == x.shape, f"residual {tuple(residual.shape)} != x {tuple(x.shape)}"
        assert residual.dtype == x.dtype, f"residual {residual.dtype} != x {x.dtype}"
    rows = x.reshape(-1, hidden)  # [rows, hidden]: a view for packed [T, hidden] inputs
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    new_residual = torch.empty_like(out) if residual is not None else out
    residual_rows = rows if residual is None else residual.reshape(-1, hidden)
    if residual_rows.stride(-1) != 1:
        residual_rows = residual_rows.contiguous()
    if rows.shape[0] > 0:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(rows.shape[0],)](
            rows,
            residual_rows,
            weight.contiguous(),
            out,
            new_residual,
            hidden,
            eps,
            rows.stride(0),
            residual_rows.stride(0),
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            INTERPRETED=x.device.type == "cpu",  # CPU tensors reach the kernel only under the interpreter
            num_warps=min(max(block // ELEMENTS_PER_WARP, 1), MAX_WARPS),
        )
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), new_residual.view(x.shape)
