"""The tanh-GELU-and-multiply kernel (Gemma's MLP), run by Triton's interpreter on CPU tensors, against its torch
twin: float32 and bfloat16, widths within one tile and across tiles, rows read through a stride, leading dims, an
empty batch, gates far out on both sides where tanh saturates."""

from __future__ import annotations

from tests.kernelfixture import single_thread  # noqa: F401  (first: it puts triton in interpreter mode)

import pytest
import torch

pytest.importorskip("triton")

from kernels.gelu_mul import BLOCK, gelu_mul_launch  # noqa: E402
from services.worker.model.gated_activation import gelu_tanh_and_mul, gelu_tanh_and_mul_torch  # noqa: E402

ROWS = 3
SCALE = 4.0  # gate values out to where gelu is the identity and far below zero, where it vanishes
# Relative: the kernel spells tanh through exp, a few float32 ulps from torch's tanh.
FLOAT32_TOLERANCE = 1e-5
BFLOAT16_TOLERANCE = 2.0**-7  # one bfloat16 ulp, relative: a value on a rounding boundary may round the other way
CANCELLATION_BELOW = 2.0**-10  # outputs this small come from gates where torch's formula loses its digits


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    tolerance = FLOAT32_TOLERANCE if got.dtype == torch.float32 else BFLOAT16_TOLERANCE
    torch.testing.assert_close(got.double(), want.double(), rtol=tolerance, atol=FLOAT32_TOLERANCE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [40, BLOCK + 300])
def test_kernel_matches_twin(dtype: torch.dtype, width: int) -> None:
    generator = torch.Generator().manual_seed(width)
    gate_up = (SCALE * torch.randn(ROWS, 2 * width, generator=generator)).to(dtype)
    got = gelu_mul_launch(gate_up)
    want = gelu_tanh_and_mul_torch(gate_up)
    _close(got, want)
    if dtype == torch.bfloat16:
        # Rounded where the twin rounds: all but boundary cases are bit-equal. Far below zero torch's 1 + tanh(y)
        # cancels (to 0 from x < -5.3) where the kernel's x * sigmoid(2y) keeps the tiny true value: compared
        # above by the absolute tolerance, not bit for bit.
        exact = want.float().abs() >= CANCELLATION_BELOW
        assert (got != want)[exact].float().mean().item() < 0.01


def test_saturated_gates_strided_rows_leading_dims_and_an_empty_batch() -> None:
    generator = torch.Generator().manual_seed(1)
    extreme = torch.tensor([[-60.0, -12.0, 0.0, 12.0, 60.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    _close(gelu_mul_launch(extreme), gelu_tanh_and_mul_torch(extreme))
    wide = torch.randn(ROWS, 100, generator=generator)
    _close(gelu_mul_launch(wide[:, :80]), gelu_tanh_and_mul_torch(wide[:, :80].contiguous()))
    batched = torch.randn(2, ROWS, 64, generator=generator)
    _close(gelu_mul_launch(batched), gelu_tanh_and_mul_torch(batched))
    assert gelu_mul_launch(torch.empty(0, 64)).shape == (0, 32)


def test_dispatcher_runs_the_twin_on_cpu_and_launcher_checks_shapes() -> None:
    gate_up = torch.randn(ROWS, 64)
    assert torch.equal(gelu_tanh_and_mul(gate_up), gelu_tanh_and_mul_torch(gate_up))
    with pytest.raises(AssertionError, match="2 \\* width"):
        gelu_mul_launch(torch.randn(ROWS, 63))
    with pytest.raises(AssertionError, match="floating point"):
        gelu_mul_launch(torch.ones(ROWS, 64, dtype=torch.int64))
