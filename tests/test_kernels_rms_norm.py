"""The fused RMSNorm (+ residual add) kernel, run by Triton's interpreter on CPU tensors, against its torch twin,
and both against Hugging Face's LlamaRMSNorm: float32 and bfloat16, with and without a residual, hidden sizes that
are and are not powers of two, rows read through a stride."""

from __future__ import annotations

from tests.kernelfixture import single_thread  # noqa: F401  (first: it puts triton in interpreter mode)

import pytest
import torch

pytest.importorskip("triton")

from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402

from kernels.rms_norm import MAX_HIDDEN, rms_norm_launch  # noqa: E402
from services.worker.model.rms_norm import rms_norm, rms_norm_torch  # noqa: E402

EPS = 1e-6
ROWS = 5
FLOAT32_TOLERANCE = 1e-5
# One bfloat16 ulp at the outputs' magnitude (|value| < 8): the float32 sums differ in order, so a value that sits
# on a rounding boundary may round the other way (none did in these cases: the interpreter's rows were bit-equal).
BFLOAT16_TOLERANCE = 2.0**-5


def _inputs(hidden: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, hidden, generator=generator).to(dtype)
    residual = torch.randn(ROWS, hidden, generator=generator).to(dtype)
    weight = (1 + 0.5 * torch.randn(hidden, generator=generator)).to(dtype)
    return x, residual, weight


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    tolerance = FLOAT32_TOLERANCE if dtype == torch.float32 else BFLOAT16_TOLERANCE
    error = (got.double() - want.double()).abs().max().item()
    assert error <= tolerance, f"max error {error} > {tolerance}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 96])
def test_kernel_matches_twin_and_hugging_face(dtype: torch.dtype, hidden: int) -> None:
    x, residual, weight = _inputs(hidden, dtype, seed=hidden)
    reference = LlamaRMSNorm(hidden, eps=EPS).to(dtype)
    reference.weight.data.copy_(weight)
    with torch.no_grad():
        hf_alone, hf_fused = reference(x), reference(x + residual)

    alone = rms_norm_launch(x, weight, EPS)
    _close(alone, rms_norm_torch(x, weight, EPS), dtype)
    _close(alone, hf_alone, dtype)
    _close(rms_norm_torch(x, weight, EPS), hf_alone, dtype)

    normed, new_residual = rms_norm_launch(x, weight, EPS, residual)
    want_normed, want_residual = rms_norm_torch(x, weight, EPS, residual)
    assert torch.equal(new_residual, want_residual)  # one rounded add either way
    _close(normed, want_normed, dtype)
    _close(normed, hf_fused, dtype)


def test_strided_rows_leading_dims_and_an_empty_batch() -> None:
    """Rows may be a slice of a wider tensor (read through their stride), inputs may carry leading dims, and the
    outputs are fresh tensors: the inputs are left as they were."""
    x, residual, weight = _inputs(48, torch.float32, seed=3)
    wide = torch.randn(ROWS, 80)
    wide[:, :48] = x
    before = wide.clone()
    normed, new_residual = rms_norm_launch(wide[:, :48], weight, EPS, residual)
    want_normed, want_residual = rms_norm_torch(x, weight, EPS, residual)
    _close(normed, want_normed, torch.float32)
    assert torch.equal(new_residual, want_residual) and torch.equal(wide, before)

    batched = x.view(1, ROWS, 48)
    _close(rms_norm_launch(batched, weight, EPS), rms_norm_torch(batched, weight, EPS), torch.float32)

    empty = torch.empty(0, 48)
    normed, new_residual = rms_norm_launch(empty, weight, EPS, empty)
    assert normed.shape == new_residual.shape == (0, 48)


def test_dispatcher_runs_the_twin_on_cpu_and_launcher_checks_shapes() -> None:
    x, residual, weight = _inputs(32, torch.float32, seed=4)
    assert torch.equal(rms_norm(x, weight, EPS), rms_norm_torch(x, weight, EPS))
    for got, want in zip(rms_norm(x, weight, EPS, residual), rms_norm_torch(x, weight, EPS, residual)):
        assert torch.equal(got, want)
    with pytest.raises(AssertionError, match="weight"):
        rms_norm_launch(x, weight[:16], EPS)
    with pytest.raises(AssertionError, match="dtype"):
        rms_norm_launch(x, weight.to(torch.bfloat16), EPS)
    with pytest.raises(AssertionError, match="residual"):
        rms_norm_launch(x, weight, EPS, residual[:2])
    with pytest.raises(AssertionError, match="hidden"):
        rms_norm_launch(torch.empty(1, MAX_HIDDEN + 1), torch.empty(MAX_HIDDEN + 1), EPS)
