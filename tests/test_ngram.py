"""Prompt-lookup drafting."""

from __future__ import annotations

import random
import time

import pytest
import torch

from kernels.constants import PAD_TOKEN
from services.worker.drafting.ngram import NgramProposer
from services.worker.drafting.ngram_batch import ngram_propose


def test_longest_match_is_preferred_over_a_more_recent_shorter_one() -> None:
    # [1, 2, 3] recurs at the start; only [2, 3] recurs later.
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 9, 1, 2, 3]
    assert NgramProposer(max_ngram_size=3, min_ngram_size=2).propose(tokens, 3) == [4, 9, 2]
    assert NgramProposer(max_ngram_size=2, min_ngram_size=2).propose(tokens, 3) == [5, 9, 1]


def test_most_recent_occurrence_wins_among_equal_lengths() -> None:
    tokens = [7, 8, 1, 7, 8, 2, 7, 8]
    assert NgramProposer(max_ngram_size=2, min_ngram_size=1).propose(tokens, 1) == [2]


def test_min_size_is_respected() -> None:
    tokens = [5, 6, 7, 1, 9, 7]  # only the 1-gram [7] recurs
    assert NgramProposer(max_ngram_size=3, min_ngram_size=2).propose(tokens, 2) == []
    assert NgramProposer(max_ngram_size=3, min_ngram_size=1).propose(tokens, 2) == [1, 9]


def test_match_longer_than_max_counts_as_max() -> None:
    tokens = [1, 2, 3, 4, 10, 11, 3, 4, 12, 1, 2, 3, 4]
    # With max 2, the suffix [3, 4] last occurred before 12.
    assert NgramProposer(max_ngram_size=2, min_ngram_size=2).propose(tokens, 1) == [12]
    assert NgramProposer(max_ngram_size=4, min_ngram_size=2).propose(tokens, 1) == [10]


def test_fewer_drafts_near_the_end() -> None:
    tokens = [3, 4, 5, 3, 4]
    assert NgramProposer(max_ngram_size=2, min_ngram_size=2).propose(tokens, 5) == [5, 3, 4]


def test_overlapping_occurrence_of_a_repeated_token() -> None:
    assert NgramProposer(max_ngram_size=3, min_ngram_size=2).propose([7, 7, 7, 7], 3) == [7]


def test_nothing_found() -> None:
    proposer = NgramProposer(max_ngram_size=4, min_ngram_size=1)
    assert proposer.propose([1, 2, 3, 4, 5], 3) == []
    assert proposer.propose([], 3) == []
    assert proposer.propose([1], 3) == []
    assert proposer.propose([1, 1, 1], 0) == []


def test_returns_python_ints() -> None:
    drafts = NgramProposer(max_ngram_size=2, min_ngram_size=1).propose([1, 2, 1], 2)
    assert drafts == [2, 1] and all(type(t) is int for t in drafts)


def test_invalid_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="min_ngram_size"):
        NgramProposer(max_ngram_size=2, min_ngram_size=3)
    with pytest.raises(ValueError, match="min_ngram_size"):
        NgramProposer(max_ngram_size=2, min_ngram_size=0)


def _brute_force(tokens: list[int], max_size: int, min_size: int, num_drafts: int) -> list[int]:
    n = len(tokens)
    for size in range(min(max_size, n - 1), min_size - 1, -1):
        suffix = tokens[n - size :]
        for start in range(n - size - 1, -1, -1):
            if tokens[start : start + size] == suffix:
                return tokens[start + size : start + size + num_drafts]
    return []


def test_agrees_with_brute_force_on_random_sequences() -> None:
    rng = random.Random(1234)
    proposer = NgramProposer(max_ngram_size=4, min_ngram_size=2)
    for _ in range(500):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(0, 40))]
        assert proposer.propose(tokens, 3) == _brute_force(tokens, 4, 2, 3), tokens


@pytest.mark.exclusive  # bounds a time: alone, not beside another worker's tests (tests/conftest.py)
def test_fast_on_long_sequences() -> None:
    rng = random.Random(7)
    tokens = [rng.randrange(50) for _ in range(4000)]
    proposer = NgramProposer(max_ngram_size=5, min_ngram_size=2)
    started = time.perf_counter()
    for _ in range(100):
        proposer.propose(tokens, 4)
    assert time.perf_counter() - started < 1.0


def test_the_batched_op_drafts_each_row_like_the_proposer() -> None:
    rows = [[1, 2, 3, 1, 2], [7, 7, 7, 7], [4, 5]]
    tokens = torch.full((3, 6), PAD_TOKEN, dtype=torch.int64)
    for b, row in enumerate(rows):
        tokens[b, : len(row)] = torch.tensor(row)
    drafts, counts = ngram_propose(tokens, torch.tensor([5, 4, 2]), torch.tensor([3, 3, 1]), 2, 3, 1)
    assert counts.tolist() == [2, 1, 0]
    assert drafts.tolist() == [[3, 1], [7, PAD_TOKEN], [PAD_TOKEN, PAD_TOKEN]]
    with pytest.raises(ValueError, match="lengths"):
        ngram_propose(tokens, torch.tensor([5, 4]), torch.tensor([3, 3, 1]), 2, 3, 1)
