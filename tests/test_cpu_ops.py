"""The CPU's spellings of the model's ops against the formulas they replace, bit for bit: RMSNorm in float32 against
Hugging Face's formula, and the full-width rotary table against the kernel's half-width one (packed [T] and
training-shaped [B, L] inputs, float32 and bfloat16, with a rope scale on cos and sin)."""

from __future__ import annotations

import pytest
import torch

from shared.config import DEFAULT_MODEL_DIR
from services.worker.model.config import ModelConfig
from services.worker.model.layers import Rotary
from services.worker.model.rms_norm import rms_norm_torch
from services.worker.model.rotary_apply import apply_rotary, apply_rotary_full, apply_rotary_torch

POSITIONS = 96
HEADS = 12  # q and k heads of a fused projection, rotated together


def _half_width(full: torch.Tensor) -> torch.Tensor:
    """[..., 2, 1, head_dim] (cos|cos, -sin|sin) -> the kernel's [..., 2, head_dim / 2] (cos, sin)."""
    half = full.shape[-1] // 2
    return torch.stack((full[..., 0, 0, :half], full[..., 1, 0, half:]), dim=-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("leading", [(7,), (2, 5)])
def test_full_width_rotation_equals_the_twin(dtype: torch.dtype, leading: tuple[int, ...]) -> None:
    cfg = ModelConfig.from_dir(DEFAULT_MODEL_DIR)
    rotary = Rotary(cfg, POSITIONS, "cpu")
    rotary.attention_scaling = 1.1  # a scaled rope type's factor reaches both layouts alike
    rotary._grow(POSITIONS)
    assert rotary.full_width and rotary.cos_sin.shape == (POSITIONS, 2, 1, cfg.head_dim)
    generator = torch.Generator().manual_seed(len(leading))
    positions = torch.randint(0, POSITIONS, leading, generator=generator)
    x = torch.randn(*leading, HEADS, cfg.head_dim, generator=generator).to(dtype)
    full = rotary(positions, POSITIONS)
    want = apply_rotary_torch(x, _half_width(full))
    assert torch.equal(apply_rotary_full(x, full), want)
    assert torch.equal(apply_rotary(x, full), want)  # the dispatcher reads the layout from the table's width


@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("hidden", [256, 896, 4096])
def test_float32_rms_norm_is_hugging_faces_formula(rows: int, hidden: int) -> None:
    generator = torch.Generator().manual_seed(rows * hidden)
    x, residual = (torch.randn(rows, hidden, generator=generator) * 3 for _ in range(2))
    weight = torch.randn(hidden, generator=generator)
    eps = 1e-6

    def hugging_face(h: torch.Tensor) -> torch.Tensor:
        return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))

    assert torch.equal(rms_norm_torch(x, weight, eps), hugging_face(x))
    normed, summed = rms_norm_torch(x, weight, eps, residual)
    assert torch.equal(summed, x + residual) and torch.equal(normed, hugging_face(x + residual))
