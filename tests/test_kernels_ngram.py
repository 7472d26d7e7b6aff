"""The batched n-gram kernel, run by Triton's interpreter on CPU tensors, against NgramProposer row by row."""

from __future__ import annotations

from tests.kernelfixture import single_thread  # noqa: F401  (first: it puts triton in interpreter mode)

import random

import pytest
import torch

pytest.importorskip("triton")

from kernels.constants import PAD_TOKEN  # noqa: E402
from kernels.ngram import ngram_propose_launch  # noqa: E402
from services.worker.drafting.ngram_batch import ngram_propose, ngram_propose_torch  # noqa: E402


def _padded(rows: list[list[int]], width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows)) if width is None else width
    tokens = torch.full((len(rows), width), PAD_TOKEN, dtype=torch.int64)
    for b, row in enumerate(rows):
        tokens[b, : len(row)] = torch.tensor(row, dtype=torch.int64)
    return tokens, torch.tensor([len(row) for row in rows])


def test_known_cases_in_one_ragged_batch() -> None:
    rows = [
        [1, 2, 3, 4, 9, 2, 3, 5, 9, 1, 2, 3],  # the longest match [1, 2, 3] beats the more recent [2, 3]
        [7, 8, 1, 7, 8, 2, 7, 8],  # the most recent among equal lengths
        [3, 4, 5, 3, 4],  # fewer drafts near the end
        [7, 7, 7, 7],  # an overlapping occurrence
        [1, 2, 3, 4, 5],  # nothing recurs
        [],
    ]
    tokens, lengths = _padded(rows, width=16)
    drafts, counts = ngram_propose_launch(tokens, lengths, torch.full((6,), 3), 3, 3, 2)
    assert counts.tolist() == [3, 3, 3, 1, 0, 0]
    assert drafts.tolist()[:4] == [[4, 9, 2], [2, 7, 8], [5, 3, 4], [7, PAD_TOKEN, PAD_TOKEN]]
    assert bool((drafts[4:] == PAD_TOKEN).all())


@pytest.mark.parametrize("case", range(6))
def test_kernel_matches_the_proposer_on_random_batches(case: int) -> None:
    rng = random.Random(case)
    alphabet = [2, 3, 5, 20, 97, 4099][case]
    width = rng.randint(1, 300)
    rows = [[rng.randrange(alphabet) for _ in range(rng.randint(0, width))] for _ in range(5)]
    tokens, lengths = _padded(rows, width)
    max_size = rng.randint(1, 5)
    min_size = rng.randint(1, max_size)
    k = case % 6  # 0..5 drafts
    num_drafts = torch.tensor([rng.randint(0, 6) for _ in rows])
    got = ngram_propose_launch(tokens, lengths, num_drafts, k, max_size, min_size)
    want = ngram_propose_torch(tokens, lengths, num_drafts, k, max_size, min_size)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_dispatcher_runs_the_twin_on_cpu_and_launcher_checks_shapes() -> None:
    tokens, lengths = _padded([[1, 2, 1, 2, 1]])
    assert ngram_propose(tokens, lengths, torch.tensor([2]), 2, 2, 1)[0].tolist() == [[2, 1]]
    with pytest.raises(AssertionError, match="length"):
        ngram_propose_launch(tokens, lengths + 1, torch.tensor([2]), 2, 2, 1)
    with pytest.raises(AssertionError, match="int64"):
        ngram_propose_launch(tokens.to(torch.int32), lengths, torch.tensor([2]), 2, 2, 1)
