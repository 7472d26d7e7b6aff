"""Rotary position embedding applied to query and key heads, half-split layout (Hugging Face's Llama and Qwen2).

Two cos/sin tables, built by model/layers.Rotary in the layout its device reads:
- half width, [..., 2, head_dim / 2]: the kernel of kernels/rotary.py on CUDA rotates in place;
  `apply_rotary_torch` is its twin (and what a CUDA training step runs);
- full width, [..., 2, 1, head_dim], cos|cos and -sin|sin: `apply_rotary_full`, the CPU path, four torch ops
  where the twin takes nine (a decode step of a small model is mostly such overhead). It computes the same float32
  products and sums as the twin, so the two are equal bit for bit.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels import use_inference_kernel


def apply_rotary(x: Tensor, cos_sin: Tensor) -> Tensor:
    """x [..., heads, head_dim] rotated by cos_sin (float32, the same leading dims, either table layout).

    With the kernel, x is rotated in place and returned; otherwise the result is a new tensor and x is left as it
    was. Callers use the result and do not read x again, so both are the same to them.
    """
    if cos_sin.shape[-1] == x.shape[-1]:
        return apply_rotary_full(x, cos_sin)
    if use_inference_kernel(x):
        # Imported here: CPU callers never need triton.
        from kernels.rotary import rotary_launch

        return rotary_launch(x, cos_sin)
    return apply_rotary_torch(x, cos_sin)


def apply_rotary_full(x: Tensor, cos_sin: Tensor) -> Tensor:
    """`apply_rotary` over the full-width table [..., 2, 1, head_dim]: x * cos + rotate_half(x) * sin, where
    rotating the halves is a roll and sin's sign is already in the table."""
    cos, sin = cos_sin.unbind(-3)  # [..., 1, head_dim] each
    if x.dtype != torch.float32:
        return apply_rotary_full(x.float(), cos_sin).to(x.dtype)
    out = x * cos
    out += torch.roll(x, x.shape[-1] // 2, -1) * sin
    return out


def apply_rotary_torch(x: Tensor, cos_sin: Tensor) -> Tensor:
    """`apply_rotary` over the half-width table in torch ops, out of place, on any device: the kernel's
    reference."""
    cos, sin = cos_sin[..., None, 0, :], cos_sin[..., None, 1, :]
    xf = x.float()
    half = x.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
