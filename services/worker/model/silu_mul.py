"""SwiGLU's activation over the merged gate/up projection: the kernel of kernels/silu_mul.py on CUDA,
`silu_and_mul_torch` (its twin and the CPU path) elsewhere."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from kernels import use_inference_kernel


def silu_and_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up [..., width], gate and up being the halves of gate_up [..., 2 * width]."""
    if use_inference_kernel(gate_up):
        # Imported here: CPU callers never need triton.
        from kernels.silu_mul import silu_mul_launch

        return silu_mul_launch(gate_up)
    return silu_and_mul_torch(gate_up)


def silu_and_mul_torch(gate_up: Tensor) -> Tensor:
    """`silu_and_mul` in torch ops, on any device: the kernel's reference and the CPU path."""
    width = gate_up.shape[-1] // 2
    return F.silu(gate_up.narrow(-1, 0, width)) * gate_up.narrow(-1, width, width)
