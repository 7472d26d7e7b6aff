"""The CPU's full-width rotary table against the kernel's half-width one: the same rotation, bit for bit, for packed
[T] and training-shaped [B, L] inputs, float32 and bfloat16, with a rope scale on cos and sin."""

from __future__ import annotations

import pytest
import torch

from shared.config import DEFAULT_MODEL_DIR
from services.worker.model.config import ModelConfig
from services.worker.model.layers import Rotary
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
