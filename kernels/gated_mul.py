"""A gated MLP's activation over the merged gate/up projection: out = act(gate) * up, where gate and up are the two
halves of each row of gate_up [..., 2 * width] and act is SiLU (SwiGLU: Llama, Qwen, Mistral and the others) or
tanh-approximated GELU (GeGLU: Gemma 3). Twins: services/worker/model/gated_activation.py's `*_torch`.

Layout: one program per (row, tile of BLOCK columns). act(gate) is computed in float32 and rounded to the model dtype
before the product, which is rounded again: the two roundings of torch's eager `act(gate) * up` in that dtype.
tanh-GELU, x / 2 * (1 + tanh(y)) with y = sqrt(2 / pi) * (x + 0.044715 x^3), is computed as x * sigmoid(2y), the
same function: no tanh is needed, it saturates cleanly at both ends, and it keeps the digits torch's own formula
loses where 1 + tanh(y) is small (x well below zero, where torch flushes to 0 from x < -5.3).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.rounding import cast

BLOCK = 1024
NUM_WARPS = 4
# The activation, by the name model configs give it (services/worker/model/config.py's SILU, GELU_TANH)
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
GELU_TANH = tl.constexpr(ACTIVATIONS["gelu_tanh"])
SQRT_2_OVER_PI = tl.constexpr(math.sqrt(2.0 / math.pi))
CUBIC = tl.constexpr(0.044715)  # the tanh approximation's cubic coefficient


@triton.jit
def _gated_mul_kernel(
    gate_up_ptr,  # [rows, 2 * width], the last dim contiguous
    out_ptr,  # [rows, width], contiguous
    width,
    stride_gate_up,
    ACTIVATION: tl.constexpr,  # ACTIVATIONS' value of "silu" or "gelu_tanh"
    BLOCK: tl.constexpr,
    INTERPRETED: tl.constexpr,  # CPU tensors in Triton's interpreter: bfloat16 rounding done on the bits
):
    dtype = out_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < width
    gate_row = gate_up_ptr + row * stride_gate_up
    gate = tl.load(gate_row + cols, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(gate_row + width + cols, mask=inside, other=0.0).to(tl.float32)
    # Both activations are x * sigmoid(z): z = x for SiLU, z = 2y for tanh-GELU
    z = gate
    if ACTIVATION == GELU_TANH:
        z = 2.0 * SQRT_2_OVER_PI * (gate + CUBIC * gate * gate * gate)
    act = cast(gate / (1.0 + tl.exp(-z)), dtype, INTERPRETED).to(tl.float32)
    tl.store(out_ptr + row * width + cols, cast(act * up, dtype, INTERPRETED), mask=inside)


def gated_mul_launch(gate_up: Tensor, activation: str) -> Tensor:
    """act(gate) * up [..., width] from gate_up [..., 2 * width], in its dtype; activation: "silu" or "gelu_tanh".
    Launches the kernel (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1)."""
    assert activation in ACTIVATIONS, f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}"
    assert gate_up.dim() >= 1, "gate_up must be [..., 2 * width]"
    assert gate_up.shape[-1] % 2 == 0, f"gate_up's last dim {gate_up.shape[-1]} must be 2 * width"
    assert gate_up.is_floating_point(), f"gate_up must be floating point, got {gate_up.dtype}"
    width = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * width)  # [rows, 2 * width]
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], width, dtype=gate_up.dtype, device=gate_up.device)  # [rows, width]
    if out.numel() > 0:
        _gated_mul_kernel[(rows.shape[0], triton.cdiv(width, BLOCK))](
            rows,
            out,
            width,
            rows.stride(0),
            ACTIVATION=ACTIVATIONS[activation],
            BLOCK=BLOCK,
            INTERPRETED=gate_up.device.type == "cpu",  # CPU tensors reach the kernel only under the interpreter
            num_warps=NUM_WARPS,
        )
    return out.view(*gate_up.shape[:-1], width)
