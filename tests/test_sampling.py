"""Counter-based uniforms, logits processing and exponential-race sampling."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from services.worker.sampling.random import (
    GOLDEN_GAMMA,
    UNIFORM_BITS,
    Purpose,
    PYTHON_KEY_ROWS,
    _key_on_host,
    _to_int64,
    _to_unit_interval,
    host_keys,
    host_uniform_into,
    mix64,
    uniform,
)
from services.worker.sampling.sample import process_logits, sample, sample_torch
from shared.schemas import GREEDY_BELOW, SamplingParams

UINT64_MASK = (1 << 64) - 1


def _splitmix64_finaliser(x: int) -> int:
    """The published splitmix64 finaliser on Python ints, to check the int64 tensor version bit for bit."""
    x &= UINT64_MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & UINT64_MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & UINT64_MASK
    return x ^ (x >> 31)


def _row(values: list[float]) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float32)


def _params(n: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
    return (
        torch.full((n,), temperature),
        torch.full((n,), top_k, dtype=torch.int64),
        torch.full((n,), top_p),
    )


def test_mix64_matches_reference_bits() -> None:
    values = [0, 1, -1, 42, 12345678901234567, -(1 << 63), (1 << 63) - 1]
    got = mix64(torch.tensor(values, dtype=torch.int64)).tolist()
    assert [g & UINT64_MASK for g in got] == [_splitmix64_finaliser(v) for v in values]


def test_uniforms_strictly_inside_unit_interval_and_uniform() -> None:
    n = 200_000
    seeds = torch.arange(n, dtype=torch.int64) * 7919 - 10**12
    u = uniform(seeds, torch.arange(n, dtype=torch.int64) % 97, Purpose.SAMPLE)
    assert u.dtype == torch.float64 and u.shape == (n,)
    assert bool((u > 0).all()) and bool((u < 1).all())
    counts = torch.histc(u, bins=20, min=0.0, max=1.0)
    expected = n / 20
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 60.0  # 19 degrees of freedom: p < 1e-5 beyond this
    assert abs(float(u.mean()) - 0.5) < 0.005


def test_uniform_extremes_of_the_grid_stay_inside() -> None:
    lowest_and_highest_bits = torch.tensor([0, -1], dtype=torch.int64)  # -1 is all 64 bits set
    u = _to_unit_interval(lowest_and_highest_bits).tolist()
    assert u == [2.0 ** -(UNIFORM_BITS + 1), 1.0 - 2.0 ** -(UNIFORM_BITS + 1)]
    assert 0.0 < u[0] and u[1] < 1.0


def test_uniform_is_a_function_of_seed_position_purpose() -> None:
    seeds = torch.tensor([3, 3, 3, 4], dtype=torch.int64)
    positions = torch.tensor([10, 11, 10, 10], dtype=torch.int64)
    first = uniform(seeds, positions, Purpose.ACCEPT)
    assert torch.equal(first, uniform(seeds, positions, Purpose.ACCEPT))
    assert first[0] == first[2]  # the same coordinates in another batch slot
    assert len({float(first[0]), float(first[1]), float(first[3])}) == 3  # position and seed both change it
    assert not torch.equal(first, uniform(seeds, positions, Purpose.SAMPLE))
    alone = uniform(seeds[2:3], positions[2:3], Purpose.ACCEPT)
    assert torch.equal(alone, first[2:3])


def test_uniform_width_rows_are_independent_of_the_batch() -> None:
    seeds = torch.tensor([5, 6, 7], dtype=torch.int64)
    positions = torch.tensor([0, 1, 2], dtype=torch.int64)
    wide = uniform(seeds, positions, Purpose.SAMPLE, width=1000)
    assert wide.shape == (3, 1000)
    assert torch.equal(wide[1:2], uniform(seeds[1:2], positions[1:2], Purpose.SAMPLE, width=1000))
    assert torch.equal(wide[:, :10], uniform(seeds, positions, Purpose.SAMPLE, width=10))
    assert len(set(wide[0].tolist())) == 1000


def test_temperature_scales_logits() -> None:
    logits = _row([1.0, 2.0, 3.0, 0.5])
    probs = process_logits(logits, *_params(1, temperature=0.5))
    assert torch.allclose(probs, torch.softmax(logits / 0.5, dim=-1))


def test_zero_temperature_is_one_hot_at_argmax() -> None:
    logits = torch.tensor([[0.1, 5.0, 2.0], [3.0, 1.0, 2.0]])
    probs = process_logits(logits, torch.tensor([0.0, 1.0]), torch.zeros(2, dtype=torch.int64), torch.ones(2))
    assert torch.equal(probs[0], torch.tensor([0.0, 1.0, 0.0]))
    assert torch.allclose(probs[1], torch.softmax(logits[1], dim=-1))


def test_top_k_keeps_k_most_likely_and_renormalises() -> None:
    logits = _row([1.0, 4.0, 3.0, 2.0, 0.0])
    probs = process_logits(logits, *_params(1, top_k=2))
    expected = torch.zeros(5)
    expected[[1, 2]] = torch.softmax(torch.tensor([4.0, 3.0]), dim=-1)
    assert torch.allclose(probs[0], expected)


def test_top_k_keeps_every_token_tied_with_the_kth_as_vllm_does() -> None:
    logits = _row([3.0, 2.0, 2.0, 2.0, 1.0, 0.0])
    probs = process_logits(logits, *_params(1, top_k=2))
    expected = torch.zeros(6)
    expected[:4] = torch.softmax(torch.tensor([3.0, 2.0, 2.0, 2.0]), dim=-1)
    assert torch.allclose(probs[0], expected)


def test_a_temperature_below_greedy_below_is_greedy() -> None:
    """Logits divided by 1e-40 overflow float32 and gave NaN probabilities (token 0 every step)."""
    assert SamplingParams(temperature=1e-40).greedy and SamplingParams(temperature=GREEDY_BELOW / 2).greedy
    assert not SamplingParams(temperature=GREEDY_BELOW).greedy


def test_top_k_larger_than_vocab_is_a_no_op() -> None:
    logits = _row([1.0, 2.0, 3.0])
    assert torch.allclose(process_logits(logits, *_params(1, top_k=50)), torch.softmax(logits, dim=-1))


def test_top_p_keeps_smallest_set_reaching_the_mass() -> None:
    base = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = base.log()
    for top_p, kept in [(0.5, 1), (0.6, 2), (0.8, 2), (0.81, 3), (0.96, 4)]:
        probs = process_logits(logits, *_params(1, top_p=top_p))[0]
        assert int((probs > 0).sum()) == kept, top_p
        assert torch.allclose(probs[:kept], base[0, :kept] / base[0, :kept].sum())


def test_tiny_top_p_keeps_the_top_token() -> None:
    probs = process_logits(_row([0.0, 1.0, 0.9]), *_params(1, top_p=1e-6))
    assert torch.equal(probs[0], torch.tensor([0.0, 1.0, 0.0]))


def test_top_p_applies_to_the_top_k_distribution() -> None:
    # Top-2 renormalised is (0.625, 0.375): top_p 0.6 then keeps only the first.
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()
    probs = process_logits(logits, *_params(1, top_k=2, top_p=0.6))
    assert torch.equal(probs[0], torch.tensor([1.0, 0.0, 0.0]))


def test_rows_are_processed_independently() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0]] * 3)
    probs = process_logits(
        logits, torch.tensor([1.0, 1.0, 0.0]), torch.tensor([2, 0, 0]), torch.tensor([1.0, 1.0, 1.0])
    )
    assert int((probs[0] > 0).sum()) == 2
    assert torch.allclose(probs[1], torch.softmax(logits[1], dim=-1))
    assert torch.equal(probs[2], torch.tensor([0.0, 0.0, 0.0, 1.0]))


def test_sample_one_hot_rows_yield_the_hot_index() -> None:
    probs = torch.zeros(50, 7)
    hot = torch.arange(50) % 7
    probs[torch.arange(50), hot] = 1.0
    tokens = sample(probs, torch.arange(50, dtype=torch.int64), torch.zeros(50, dtype=torch.int64))
    assert torch.equal(tokens, hot)


def test_sample_never_picks_zero_probability_tokens() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5]]).expand(2000, 4)
    tokens = sample(probs, torch.arange(2000, dtype=torch.int64), torch.arange(2000, dtype=torch.int64))
    assert set(tokens.tolist()) == {1, 3}


def test_sample_frequencies_follow_probs() -> None:
    p = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    n = 40_000
    tokens = sample(p.expand(n, 5), torch.arange(n, dtype=torch.int64), torch.full((n,), 3, dtype=torch.int64))
    freq = torch.bincount(tokens, minlength=5).double() / n
    sigma = (p.double() * (1 - p.double()) / n).sqrt()
    assert bool(((freq - p.double()).abs() < 5 * sigma).all()), freq


def test_sample_is_deterministic_and_independent_of_batch_composition() -> None:
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(6, 300), dim=-1)
    seeds = torch.tensor([11, 12, 13, 14, 15, 16], dtype=torch.int64)
    positions = torch.tensor([0, 5, 9, 2, 2, 40], dtype=torch.int64)
    batch = sample(probs, seeds, positions)
    assert torch.equal(batch, sample(probs, seeds, positions))
    for i in range(6):
        assert int(sample(probs[i : i + 1], seeds[i : i + 1], positions[i : i + 1])) == int(batch[i])
    order = torch.tensor([5, 3, 1, 0, 4, 2])
    assert torch.equal(sample(probs[order], seeds[order], positions[order]), batch[order])


def test_sample_differs_across_positions_and_purposes() -> None:
    probs = torch.full((1, 1000), 1.0 / 1000)
    seed = torch.tensor([99], dtype=torch.int64)
    by_position = {int(sample(probs, seed, torch.tensor([pos]))) for pos in range(20)}
    assert len(by_position) > 15
    by_purpose = {int(sample(probs, seed, torch.tensor([0]), purpose)) for purpose in Purpose}
    assert len(by_purpose) == len(Purpose)


def test_global_rng_is_untouched() -> None:
    state = torch.random.get_rng_state()
    logits = torch.tensor([[0.3, 1.2, -0.5, 2.0]] * 4)
    temperature = torch.tensor([0.7, 1.0, 0.0, 1.3])
    probs = process_logits(logits, temperature, torch.tensor([0, 2, 0, 3]), torch.full((4,), 0.9))
    sample(probs, torch.arange(4, dtype=torch.int64), torch.arange(4, dtype=torch.int64))
    uniform(torch.arange(4, dtype=torch.int64), torch.arange(4, dtype=torch.int64), Purpose.DRAFT, width=8)
    assert torch.equal(torch.random.get_rng_state(), state)


def test_uniform_rejects_mismatched_inputs() -> None:
    with pytest.raises(ValueError, match="equal 1-d shapes"):
        uniform(torch.zeros(3, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), Purpose.SAMPLE)
    with pytest.raises(TypeError, match="int64"):
        uniform(torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.int64), Purpose.SAMPLE)


def test_log_of_uniform_is_finite() -> None:
    seeds = torch.arange(10_000, dtype=torch.int64)
    u = uniform(seeds, seeds, Purpose.SAMPLE, width=64)
    assert bool(torch.isfinite(-torch.log(u)).all())
    assert math.isfinite(float((-torch.log(u)).max()))


def test_min_p_drops_tokens_below_its_share_of_the_top_after_temperature() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    temperature, top_k, top_p = _params(2)
    probs = process_logits(logits, temperature, top_k, top_p, torch.tensor([0.25, 0.0]))
    # Row 0 keeps the tokens at least 0.25 * 0.5 likely, renormalised; row 1 (min_p 0) keeps all.
    assert torch.allclose(probs[0], torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)
    assert torch.allclose(probs[1], torch.tensor([0.5, 0.3, 0.15, 0.05]))
    # After temperature 2 the tail is flatter: 0.05 ** 0.5 is above a quarter of 0.5 ** 0.5, so it stays.
    hot = process_logits(logits[:1], torch.tensor([2.0]), top_k[:1], top_p[:1], torch.tensor([0.25]))
    assert bool((hot > 0).all())


@pytest.mark.parametrize("rows, vocab, dtype", [
    (0, 4096, torch.float32), (1, 4096, torch.float32), (16, 4096, torch.float64), (17, 4096, torch.float32),
    (33, 1001, torch.bfloat16), (3, 40000, torch.float32),
])
def test_the_cpu_race_in_chunks_draws_what_the_whole_race_draws(rows: int, vocab: int, dtype: torch.dtype) -> None:
    """sample_torch on the CPU runs the race a chunk of rows at a time with in-place noise (host_uniform_into): every
    token must be the one the race over the whole batch at once picks, and the noise uniform's, bit for bit."""
    generator = torch.Generator().manual_seed(rows * vocab)
    probs = torch.softmax(torch.randn(rows, vocab, generator=generator), dim=-1).to(dtype)
    if rows > 2:
        probs[1] = 0
        probs[1, 7] = 1  # one-hot
        probs[2, : vocab // 2] = 0  # zero-probability entries
    seeds = torch.randint(-(2**62), 2**62, (rows,), generator=generator)
    positions = torch.randint(0, 10**6, (rows,), generator=generator)
    for purpose in Purpose:
        whole = (probs.to(torch.float64) / -torch.log(uniform(seeds, positions, purpose, width=vocab))).argmax(-1)
        assert torch.equal(sample_torch(probs, seeds, positions, purpose), whole)
        out = np.empty((rows, vocab), dtype=np.float64)
        scratch = (np.empty((rows, vocab), dtype=np.uint64), np.empty((rows, vocab), dtype=np.uint64))
        in_place = host_uniform_into(host_keys(seeds, positions, purpose), out, *scratch)
        assert torch.equal(torch.from_numpy(in_place), uniform(seeds, positions, purpose, vocab))


@pytest.mark.parametrize("rows", [1, PYTHON_KEY_ROWS, 64])
def test_host_keys_equal_the_torch_hash(rows: int) -> None:
    """The CPU's keys, hashed in Python's integers for a few rows and in numpy's uint64 arithmetic for more, have the
    bits of the int64 torch chain the CUDA path and the kernels follow, for negative seeds and every purpose."""
    generator = torch.Generator().manual_seed(17)
    seeds = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=generator, dtype=torch.int64)
    positions = torch.randint(0, 2**31, (rows,), generator=generator, dtype=torch.int64)
    for purpose in Purpose:
        chained = mix64(mix64(mix64(seeds + GOLDEN_GAMMA) ^ positions) + _to_int64(int(purpose) * GOLDEN_GAMMA))
        assert torch.equal(_key_on_host(seeds, positions, purpose), chained)


@pytest.mark.parametrize("rows", [1, PYTHON_KEY_ROWS, 64])
def test_host_uniforms_equal_the_torch_chain(rows: int) -> None:
    """uniform without a width on the CPU (Python's integers for a few rows, numpy beyond) has the bits of the int64
    torch chain the CUDA path follows."""
    generator = torch.Generator().manual_seed(rows)
    seeds = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=generator, dtype=torch.int64)
    positions = torch.randint(0, 2**31, (rows,), generator=generator, dtype=torch.int64)
    for purpose in Purpose:
        key = mix64(mix64(mix64(seeds + GOLDEN_GAMMA) ^ positions) + _to_int64(int(purpose) * GOLDEN_GAMMA))
        assert torch.equal(uniform(seeds, positions, purpose), _to_unit_interval(mix64(key + GOLDEN_GAMMA)))
