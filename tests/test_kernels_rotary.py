"""The in-place rotary kernel, run by Triton's interpreter on CPU tensors, against its torch twin: q and k heads of a
fused qkv projection rotated where they lie (v untouched), a cos/sin table laid out as model/layers.Rotary lays it
out ([positions, 2, head_dim / 2], float32, scaled as some rope types scale it), float32 and bfloat16, head_dim
not a power of two, [B, L] training-shaped inputs."""

from __future__ import annotations

from tests.kernelfixture import single_thread  # noqa: F401  (first: it puts triton in interpreter mode)

import pytest
import torch

pytest.importorskip("triton")

from kernels.rotary import rotary_launch  # noqa: E402
from services.worker.model.rotary_apply import apply_rotary, apply_rotary_torch  # noqa: E402

THETA = 10000.0
MAX_POSITIONS = 128
ATTENTION_SCALING = 1.1  # yarn-style rope types scale cos and sin; the kernel reads whatever the table holds
TOKENS = 7
FLOAT32_TOLERANCE = 1e-6  # the same float32 products and sums; only a fused multiply-add could differ


def _fused_qkv(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int):
    """(qkv [T, heads + 2 kv_heads, head_dim], cos_sin [T, 2, head_dim / 2]) at random positions."""
    generator = torch.Generator().manual_seed(seed)
    qkv = torch.randn(TOKENS, heads + 2 * kv_heads, head_dim, generator=generator).to(dtype)
    positions = torch.randint(0, MAX_POSITIONS, (TOKENS,), generator=generator)
    return qkv, _table(head_dim)[positions]


def _table(head_dim: int) -> torch.Tensor:
    """cos and sin of every position [MAX_POSITIONS, 2, head_dim / 2], float32."""
    inv_freq = THETA ** -(torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.arange(MAX_POSITIONS).float()[:, None] * inv_freq
    return torch.stack((angles.cos(), angles.sin()), dim=1) * ATTENTION_SCALING


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 16), (6, 2, 24), (3, 1, 64)])
def test_kernel_rotates_q_and_k_in_place_like_the_twin(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> None:
    qkv, cos_sin = _fused_qkv(heads, kv_heads, head_dim, dtype, seed=heads * head_dim)
    rotated = heads + kv_heads
    want = apply_rotary_torch(qkv[:, :rotated], cos_sin)
    values = qkv[:, rotated:].clone()
    got = rotary_launch(qkv[:, :rotated], cos_sin)
    assert got.data_ptr() == qkv.data_ptr() and got.shape == want.shape
    if dtype == torch.float32:
        assert (qkv[:, :rotated] - want).abs().max().item() <= FLOAT32_TOLERANCE
    else:  # float32 arithmetic rounded once, as the twin rounds
        assert torch.equal(qkv[:, :rotated], want)
    assert torch.equal(qkv[:, rotated:], values)


def test_training_shaped_inputs_and_an_empty_batch() -> None:
    """[B, L, heads, head_dim] slices of a [B, L, ...] projection flatten to a view and rotate in place."""
    generator = torch.Generator().manual_seed(1)
    qkv = torch.randn(2, 5, 8, 16, generator=generator)
    positions = torch.arange(5).expand(2, 5)
    cos_sin = _table(16)[positions]  # [2, 5, 2, 8]
    want = apply_rotary_torch(qkv[..., :6, :], cos_sin)
    rotary_launch(qkv[..., :6, :], cos_sin)
    assert (qkv[..., :6, :] - want).abs().max().item() <= FLOAT32_TOLERANCE

    empty = torch.empty(0, 4, 16)
    assert rotary_launch(empty, torch.empty(0, 2, 8)) is empty


def test_dispatcher_runs_the_twin_on_cpu_and_launcher_checks_shapes() -> None:
    qkv, cos_sin = _fused_qkv(4, 2, 16, torch.float32, seed=2)
    before = qkv.clone()
    assert torch.equal(apply_rotary(qkv[:, :6], cos_sin), apply_rotary_torch(qkv[:, :6], cos_sin))
    assert torch.equal(qkv, before)  # the CPU path leaves its input as it was
    with pytest.raises(AssertionError, match="cos_sin"):
        rotary_launch(qkv[:, :6], cos_sin[:3])
    with pytest.raises(AssertionError, match="even"):
        rotary_launch(qkv[..., :15], cos_sin)
    swapped = torch.randn(5, 2, 8, 16).transpose(0, 1)  # [B, L, ...] with B and L swapped in memory
    with pytest.raises(RuntimeError, match="view"):  # no flat [T, heads, head_dim] view to write back to
        rotary_launch(swapped[..., :6, :], torch.zeros(2, 5, 2, 8))
