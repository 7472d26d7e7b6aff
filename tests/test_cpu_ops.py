"""The CPU's spellings of the model's ops against the formulas they replace: RMSNorm in float32 against Hugging
Face's formula and the full-width rotary table against the kernel's half-width one (packed [T] and training-shaped
[B, L] inputs, float32 and bfloat16, with a rope scale on cos and sin), bit for bit; decode and verify rows attended
in one call over their slots' home regions against one call per sequence, and a prompt piece after a prefix in two
flash calls against one masked call, up to float32 summation order."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shared.config import DEFAULT_MODEL_DIR
from services.worker.model.config import ModelConfig
from services.worker.model.layers import Rotary
from services.worker.model.home_pass import attend_home_pass, partition_runs, plan_home_pass
from services.worker.model.paged_attention import attend_after_prefix, attend_per_sequence
from services.worker.model.sequence_spans import FLASH_WITH_LSE, GATHER_MAX_QUERY_LEN, Pool, plan_spans
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


def _home_spans(regions: list[int], contexts: list[int], counts: list[int]) -> list:
    blocks_per_region = HOME_REGION // HOME_BLOCK
    rows = [list(range(r * blocks_per_region, (r + 1) * blocks_per_region)) for r in regions]
    starts = [0]
    for count in counts:
        starts.append(starts[-1] + count)
    return plan_spans(starts, contexts, rows, HOME_BLOCK, 0, HOME_GROUP, torch.device("cpu"))


@pytest.mark.parametrize(
    ("regions", "counts"),
    [
        ([0, 1, 2, 3], [1, 1, 1, 1]), ([5, 1, 3], [1, 1, 1]), ([2], [1]), ([0, 1, 2], [4, 1, 3]), ([3, 0], [2, 5]),
        ([9, 0, 4, 5], [1, 1, 1, 1]), ([12, 0, 6, 7, 1], [2, 1, 5, 1, 3]), ([40, 2], [3, 1]),
    ],
)
def test_home_pass_attends_as_each_sequence_alone(regions: list[int], counts: list[int]) -> None:
    """Decode and verify rows of sequences sitting in their slots' home regions, in order or not, with idle regions
    between them: calls over runs of regions (split where idle regions lie between two busy
    ones, or where contexts differ much) give what one call per sequence gives, up to float32 summation order."""
    keys, values = _home_pools(max(regions) + 1)
    contexts = [HOME_REGION - 7 * i for i in range(len(regions))]
    spans = _home_spans(regions, contexts, counts)
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(sum(counts), HOME_KV_HEADS * HOME_GROUP, HOME_HEAD_DIM, generator=generator)
    plan = plan_home_pass(spans, HOME_REGION, keys.flat.shape[1], HOME_GROUP, q.device)
    identity = counts == [1] * len(counts) and regions == list(range(regions[0], regions[0] + len(regions)))
    assert plan is not None and (plan.token_rows is None) == identity
    order = sorted(range(len(regions)), key=regions.__getitem__)
    bounds = partition_runs(
        [regions[i] for i in order], [contexts[i] for i in order], [counts[i] for i in order]
    )
    assert [(run.first_region, run.num_regions) for run in plan.runs] == [
        (regions[order[start]], regions[order[stop - 1]] - regions[order[start]] + 1)
        for start, stop in zip(bounds, bounds[1:])
    ]
    got = attend_home_pass(q, keys, values, plan, 0.25)
    want = attend_per_sequence(q, keys, values, spans, 0.25)
    assert torch.allclose(got, want, atol=1e-6)


def test_home_pass_is_planned_only_for_short_runs_at_a_region_start() -> None:
    keys, _ = _home_pools(4)
    cpu, positions = torch.device("cpu"), keys.flat.shape[1]
    assert plan_home_pass(_home_spans([0, 1], [10, 20], [1, 3]), HOME_REGION, positions, HOME_GROUP, cpu) is not None
    too_long = _home_spans([0, 1], [10, 40], [1, GATHER_MAX_QUERY_LEN + 1])
    assert plan_home_pass(too_long, HOME_REGION, positions, HOME_GROUP, cpu) is None
    off_home = plan_spans([0, 1, 2], [10, 20], [[0], [5, 6]], HOME_BLOCK, 0, HOME_GROUP, cpu)  # starts mid-region
    assert plan_home_pass(off_home, HOME_REGION, positions, HOME_GROUP, cpu) is None
    sparse = _home_spans([0, 30], [10, 20], [1, 1])  # 31 regions for 2 sequences: two runs, nothing idle attended
    plan = plan_home_pass(sparse, HOME_REGION, 31 * HOME_REGION + HOME_BLOCK, HOME_GROUP, cpu)
    assert [(run.first_region, run.num_regions, run.max_context) for run in plan.runs] == [(0, 1, 10), (30, 1, 20)]
    assert [run.mask for run in plan.runs] == [None, None]  # one query a region sees every key
    shared_region = _home_spans([1, 1], [10, 20], [1, 2])
    assert plan_home_pass(shared_region, HOME_REGION, positions, HOME_GROUP, cpu) is None
    past_the_cache = _home_spans([0, 4], [10, 20], [1, 1])  # region 4 ends past the pool's positions
    assert plan_home_pass(past_the_cache, HOME_REGION, positions, HOME_GROUP, cpu) is None


def test_runs_join_neighbours_of_like_context_and_split_at_idle_stretches_and_long_contexts() -> None:
    """A run is one SDPA call over every region from its first to its last, each padded to the run's longest context
    and query run: neighbours of like context join, a stretch of idle regions or a context far longer than its
    neighbours' gets a call of its own."""
    assert partition_runs(list(range(8)), [200] * 8, [1] * 8) == [0, 8]
    assert partition_runs([0, 1, 30, 31], [200] * 4, [1] * 4) == [0, 2, 4]
    assert partition_runs([0, 1, 2, 3], [40, 40, 2000, 40], [1] * 4) == [0, 2, 3, 4]
    assert partition_runs([5], [100], [4]) == [0, 1]


@pytest.mark.skipif(FLASH_WITH_LSE is None, reason="this torch build has no CPU flash attention with log-sum-exps")
@pytest.mark.parametrize("prefix", [1, 17, 300])
def test_a_piece_after_a_prefix_attends_as_one_masked_call(prefix: int) -> None:
    count, heads, kv_heads, head_dim = GATHER_MAX_QUERY_LEN + 24, 8, 4, 32
    generator = torch.Generator().manual_seed(prefix)
    queries = torch.randn(count, heads, head_dim, generator=generator)
    keys, values = (torch.randn(1, kv_heads, prefix + count, head_dim, generator=generator) for _ in range(2))
    visible = torch.ones(count, prefix + count, dtype=torch.bool).tril_(prefix)
    expected = F.scaled_dot_product_attention(
        queries.transpose(0, 1)[None], keys, values, attn_mask=visible, scale=0.17, enable_gqa=True
    )[0].transpose(0, 1)
    torch.testing.assert_close(attend_after_prefix(queries, keys, values, 0.17), expected, atol=1e-6, rtol=1e-5)


@pytest.mark.skipif(FLASH_WITH_LSE is None, reason="this torch build has no CPU flash attention with log-sum-exps")
def test_a_piece_after_a_prefix_keeps_the_model_dtype() -> None:
    count, heads, kv_heads, head_dim = GATHER_MAX_QUERY_LEN + 8, 8, 4, 32
    generator = torch.Generator().manual_seed(3)
    queries = torch.randn(count, heads, head_dim, generator=generator).bfloat16()
    keys, values = (torch.randn(1, kv_heads, 40 + count, head_dim, generator=generator).bfloat16() for _ in range(2))
    assert attend_after_prefix(queries, keys, values, 0.17).dtype == torch.bfloat16
