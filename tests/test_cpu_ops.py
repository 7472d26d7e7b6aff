"""The CPU's spellings of the model's ops against the formulas they replace: RMSNorm in float32 against Hugging
Face's formula and the full-width rotary table against the kernel's half-width one (packed [T] and training-shaped
[B, L] inputs, float32 and bfloat16, with a rope scale on cos and sin), bit for bit; a decode batch attended in one
call over its slots' home regions against one call per sequence, up to float32 summation order."""

from __future__ import annotations

import pytest
import torch

from shared.config import DEFAULT_MODEL_DIR
from services.worker.model.config import ModelConfig
from services.worker.model.layers import Rotary
from services.worker.model.paged_attention import (
    Pool,
    attend_home_decode,
    attend_per_sequence,
    plan_home_decode,
    plan_spans,
)
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


HOME_REGION = 64  # positions per slot's home region
HOME_KV_HEADS, HOME_GROUP, HOME_HEAD_DIM, HOME_BLOCK = 2, 3, 16, 16


def _home_pools(num_regions: int) -> tuple[Pool, Pool]:
    generator = torch.Generator().manual_seed(num_regions)
    shape = (HOME_KV_HEADS, num_regions * HOME_REGION + HOME_BLOCK, HOME_HEAD_DIM)
    return tuple(Pool(torch.randn(*shape, generator=generator), HOME_BLOCK) for _ in range(2))


def _home_spans(regions: list[int], contexts: list[int]) -> list:
    blocks_per_region = HOME_REGION // HOME_BLOCK
    rows = [list(range(r * blocks_per_region, (r + 1) * blocks_per_region)) for r in regions]
    return plan_spans(list(range(len(regions) + 1)), contexts, rows, HOME_BLOCK, 0, HOME_GROUP, torch.device("cpu"))


@pytest.mark.parametrize("regions", [[0, 1, 2, 3], [5, 1, 3], [2]])
def test_home_decode_attends_as_each_sequence_alone(regions: list[int]) -> None:
    """A decode batch sitting in its slots' home regions, in order or not, with idle regions between them: one SDPA
    call over views gives what one call per sequence gives, up to float32 summation order."""
    keys, values = _home_pools(max(regions) + 1)
    contexts = [HOME_REGION - 7 * i for i in range(len(regions))]
    spans = _home_spans(regions, contexts)
    q = torch.randn(len(regions), HOME_KV_HEADS * HOME_GROUP, HOME_HEAD_DIM, generator=torch.Generator().manual_seed(3))
    plan = plan_home_decode(spans, HOME_REGION, keys.flat.shape[1], q.device)
    consecutive = regions == list(range(regions[0], regions[0] + len(regions)))
    assert plan is not None and (plan.rows is None) == consecutive
    got = attend_home_decode(q, keys, values, plan, 0.25)
    want = attend_per_sequence(q, keys, values, spans, 0.25)
    assert torch.allclose(got, want, atol=1e-6)


def test_home_decode_is_planned_only_for_one_query_per_sequence_at_a_region_start() -> None:
    keys, _ = _home_pools(4)
    cpu = torch.device("cpu")
    assert plan_home_decode(_home_spans([0, 1], [10, 20]), HOME_REGION, keys.flat.shape[1], cpu) is not None
    verify = plan_spans([0, 1, 4], [10, 20], [[0], [4, 5]], HOME_BLOCK, 0, HOME_GROUP, cpu)  # 3 rows for the second
    assert plan_home_decode(verify, HOME_REGION, keys.flat.shape[1], cpu) is None
    off_home = plan_spans([0, 1, 2], [10, 20], [[0], [5, 6]], HOME_BLOCK, 0, HOME_GROUP, cpu)  # starts mid-region
    assert plan_home_decode(off_home, HOME_REGION, keys.flat.shape[1], cpu) is None
    sparse = _home_spans([0, 30], [10, 20])  # 31 regions for 2 sequences: mostly idle
    assert plan_home_decode(sparse, HOME_REGION, 31 * HOME_REGION + HOME_BLOCK, cpu) is None
