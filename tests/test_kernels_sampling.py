"""The sampling kernel, run by Triton's interpreter on CPU tensors, against its torch twin: the same ids."""

from __future__ import annotations

from tests.kernelfixture import single_thread  # noqa: F401  (first: it puts triton in interpreter mode)

import pytest
import torch

pytest.importorskip("triton")

from kernels.sampling import sample_launch  # noqa: E402
from services.worker.sampling.random import Purpose  # noqa: E402
from services.worker.sampling.sample import sample, sample_torch  # noqa: E402


@pytest.mark.parametrize("vocab", [97, 1000, 4099])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kernel_picks_the_twins_tokens(vocab: int, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(vocab)
    probs = torch.softmax(3 * torch.randn(9, vocab, generator=generator), dim=-1).to(dtype)
    probs[0] = 0.0
    probs[0, vocab - 1] = 1.0  # one-hot (a greedy row): its hot index
    probs[1, : vocab // 2] = 0.0  # zeros are never picked
    seeds = torch.randint(-(1 << 62), 1 << 62, (9,), generator=generator)
    positions = torch.randint(0, 10_000, (9,), generator=generator)
    for purpose in (Purpose.SAMPLE, Purpose.DRAFT):
        got = sample_launch(probs, seeds, positions, purpose)
        assert got.tolist() == sample_torch(probs, seeds, positions, purpose).tolist()
    assert int(got[0]) == vocab - 1 and int(got[1]) >= vocab // 2


def test_unnormalised_rows_and_an_empty_batch() -> None:
    weights = torch.rand(5, 300, generator=torch.Generator().manual_seed(1)) * 7
    seeds, positions = torch.arange(5, dtype=torch.int64), torch.arange(5, dtype=torch.int64)
    assert torch.equal(sample_launch(weights, seeds, positions), sample_torch(weights, seeds, positions))
    assert sample_launch(torch.empty(0, 10), seeds[:0], positions[:0]).shape == (0,)


def test_dispatcher_runs_the_twin_on_cpu_and_launcher_checks_shapes() -> None:
    probs = torch.full((3, 10), 0.1)
    seeds = torch.arange(3, dtype=torch.int64)
    assert torch.equal(sample(probs, seeds, seeds), sample_torch(probs, seeds, seeds))
    with pytest.raises(AssertionError, match="seeds and positions"):
        sample_launch(probs, seeds[:2], seeds[:2])
    with pytest.raises(AssertionError, match="int64"):
        sample_launch(probs, seeds.to(torch.int32), seeds)
