"""RMSNorm, with the residual add folded in: the kernel of kernels/rms_norm.py on CUDA, `rms_norm_torch` (its twin
and the CPU path) elsewhere."""

from __future__ import annotations

import torch
from torch import Tensor

from kernels import use_inference_kernel


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """norm(x) * weight [..., hidden], or with a residual (norm(x + residual) * weight, x + residual), the sum being
    the new residual. x, residual and weight share the model dtype."""
    if use_inference_kernel(x):
        # Imported here: CPU callers never need triton.
        from kernels.rms_norm import rms_norm_launch

        return rms_norm_launch(x, weight, eps, residual)
    return rms_norm_torch(x, weight, eps, residual)


def rms_norm_torch(
    x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
) -> Tensor | tuple[Tensor, Tensor]:
    """`rms_norm` in torch ops, on any device: the kernel's reference and the CPU path."""
    if residual is not None:
        x = residual = x + residual
    # Hugging Face's formula: normalise in float32, scale in the model's dtype. In float32 it is spelled in the
    # fewest dispatched ops that give the same numbers (the CPU's mean is a sum divided by the count, x.pow(2) is
    # x * x, and the casts are no-ops): a decode step on the CPU pays for every dispatch.
    if x.dtype == torch.float32:
        variance = (x * x).sum(-1, keepdim=True).div_(x.shape[-1]).add_(eps)
        normed = weight * (x * variance.rsqrt_())
    else:
        xf = x.float()
        normed = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return normed if residual is None else (normed, residual)
