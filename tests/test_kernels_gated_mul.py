"""The gated-activation kernel (SiLU and tanh-GELU times up), run by Triton's interpreter on CPU tensors, against its
torch twins: float32 and bfloat16, widths within one tile and across tiles, rows read through a stride, leading dims,
an empty batch, gates far out on both sides where the activations saturate."""

from __future__ import annotations

from tests.kernelfixture import single_thread  # noqa: F401  (first: it puts triton in interpreter mode)

import pytest
import torch

pytest.importorskip("triton")

from kernels.gated_mul import BLOCK, gated_mul_launch  # noqa: E402
from services.worker.model.config import GELU_TANH, SILU  # noqa: E402
from services.worker.model.gated_activation import gated_activation, gated_activation_torch  # noqa: E402

ROWS = 3
SCALE = 4.0  # gate values out to where the activation is the identity and far below zero, where it vanishes
# Relative: exp comes from another library, and the kernel spells tanh-GELU through it (a few float32 ulps)
FLOAT32_TOLERANCE = 1e-5
BFLOAT16_TOLERANCE = 2.0**-7  # one bfloat16 ulp, relative: a value on a rounding boundary may round the other way
# Outputs this small come from gates where torch's tanh-GELU loses its digits (1 + tanh(y) cancels): compared by the
# absolute tolerance, not bit for bit
CANCELLATION_BELOW = 2.0**-10
ACTIVATIONS = [SILU, GELU_TANH]


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    tolerance = FLOAT32_TOLERANCE if got.dtype == torch.float32 else BFLOAT16_TOLERANCE
    torch.testing.assert_close(got.double(), want.double(), rtol=tolerance, atol=FLOAT32_TOLERANCE)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [40, BLOCK + 300])
def test_kernel_matches_twin(activation: str, dtype: torch.dtype, width: int) -> None:
    generator = torch.Generator().manual_seed(width)
    gate_up = (SCALE * torch.randn(ROWS, 2 * width, generator=generator)).to(dtype)
    got = gated_mul_launch(gate_up, activation)
    want = gated_activation_torch(activation)(gate_up)
    _close(got, want)
    if dtype == torch.bfloat16:  # rounded where the twin rounds: all but boundary cases are bit-equal
        exact = want.float().abs() >= CANCELLATION_BELOW
        assert (got != want)[exact].float().mean().item() < 0.01


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_saturated_gates_strided_rows_leading_dims_and_an_empty_batch(activation: str) -> None:
    twin = gated_activation_torch(activation)
    generator = torch.Generator().manual_seed(1)
    extreme = torch.tensor([[-60.0, -12.0, 0.0, 12.0, 60.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    _close(gated_mul_launch(extreme, activation), twin(extreme))
    wide = torch.randn(ROWS, 100, generator=generator)
    _close(gated_mul_launch(wide[:, :80], activation), twin(wide[:, :80].contiguous()))
    batched = torch.randn(2, ROWS, 64, generator=generator)
    _close(gated_mul_launch(batched, activation), twin(batched))
    assert gated_mul_launch(torch.empty(0, 64), activation).shape == (0, 32)


def test_dispatcher_runs_the_twin_on_cpu_and_launcher_checks_shapes() -> None:
    gate_up = torch.randn(ROWS, 64)
    for activation in ACTIVATIONS:
        assert torch.equal(gated_activation(activation)(gate_up), gated_activation_torch(activation)(gate_up))
    with pytest.raises(AssertionError, match="2 \\* width"):
        gated_mul_launch(torch.randn(ROWS, 63), SILU)
    with pytest.raises(AssertionError, match="floating point"):
        gated_mul_launch(torch.ones(ROWS, 64, dtype=torch.int64), SILU)
    with pytest.raises(AssertionError, match="activation"):
        gated_mul_launch(gate_up, "relu")
