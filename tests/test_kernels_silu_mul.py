"""The SiLU-and-multiply kernel, run by Triton's interpreter on CPU tensors, against its torch twin: float32 and
bfloat16, widths within one tile and across tiles, rows read through a stride, leading dims, an empty batch."""

from __future__ import annotations

from tests.kernelfixture import single_thread  # noqa: F401  (first: it puts triton in interpreter mode)

import pytest
import torch

pytest.importorskip("triton")

from kernels.silu_mul import BLOCK, silu_mul_launch  # noqa: E402
from services.worker.model.silu_mul import silu_and_mul, silu_and_mul_torch  # noqa: E402

ROWS = 3
SCALE = 4.0  # gate values out to where silu saturates and far below zero
# Relative: outputs reach ~200 at this scale, and silu's exp comes from another library (a few float32 ulps off).
FLOAT32_TOLERANCE = 1e-6
# One bfloat16 ulp, relative: a product that sits on a rounding boundary may round the other way.
BFLOAT16_TOLERANCE = 2.0**-7


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    tolerance = FLOAT32_TOLERANCE if got.dtype == torch.float32 else BFLOAT16_TOLERANCE
    torch.testing.assert_close(got.double(), want.double(), rtol=tolerance, atol=FLOAT32_TOLERANCE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [40, BLOCK + 300])
def test_kernel_matches_twin(dtype: torch.dtype, width: int) -> None:
    generator = torch.Generator().manual_seed(width)
    gate_up = (SCALE * torch.randn(ROWS, 2 * width, generator=generator)).to(dtype)
    got = silu_mul_launch(gate_up)
    want = silu_and_mul_torch(gate_up)
    _close(got, want)
    if dtype == torch.bfloat16:  # rounded where the twin rounds: all but boundary cases are bit-equal
        assert (got != want).float().mean().item() < 0.01


def test_strided_rows_leading_dims_and_an_empty_batch() -> None:
    generator = torch.Generator().manual_seed(1)
    wide = torch.randn(ROWS, 100, generator=generator)
    _close(silu_mul_launch(wide[:, :80]), silu_and_mul_torch(wide[:, :80].contiguous()))
    batched = torch.randn(2, ROWS, 64, generator=generator)
    _close(silu_mul_launch(batched), silu_and_mul_torch(batched))
    assert silu_mul_launch(torch.empty(0, 64)).shape == (0, 32)


def test_dispatcher_runs_the_twin_on_cpu_and_launcher_checks_shapes() -> None:
    gate_up = torch.randn(ROWS, 64)
    assert torch.equal(silu_and_mul(gate_up), silu_and_mul_torch(gate_up))
    with pytest.raises(AssertionError, match="2 \\* width"):
        silu_mul_launch(torch.randn(ROWS, 63))
    with pytest.raises(AssertionError, match="floating point"):
        silu_mul_launch(torch.ones(ROWS, 64, dtype=torch.int64))
