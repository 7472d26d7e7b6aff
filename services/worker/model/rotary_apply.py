"""Rotary position embedding applied to query and key heads, half-split layout (Hugging Face's Llama and Qwen2):
the kernel of kernels/rotary.py on CUDA, rotating in place; `apply_rotary_torch` (its twin and the CPU path)
elsewhere. The cos/sin table comes from model/layers.Rotary."""

from __future__ import annotations

import torch
from torch import Tensor

from kernels import use_inference_kernel


def apply_rotary(x: Tensor, cos_sin: Tensor) -> Tensor:
    """x [..., heads, head_dim] rotated by cos_sin [..., 2, head_dim / 2] (float32, the same leading dims).

    On CUDA x is rotated in place and returned; elsewhere the result is a new tensor and x is left as it was.
    Callers use the result and do not read x again, so both are the same to them.
    """
    if use_inference_kernel(x):
        # Imported here: CPU callers never need triton.
        from kernels.rotary import rotary_launch

        return rotary_launch(x, cos_sin)
    return apply_rotary_torch(x, cos_sin)


def apply_rotary_torch(x: Tensor, cos_sin: Tensor) -> Tensor:
    """`apply_rotary` in torch ops, out of place, on any device: the kernel's reference and the CPU path (which
    rotates q and k of a fused projection with one set of ops)."""
    cos, sin = cos_sin[..., None, 0, :], cos_sin[..., None, 1, :]
    xf = x.float()
    half = x.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
