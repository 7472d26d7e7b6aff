"""Counter-based randomness: every random number is a pure function of (request seed, token position, purpose).

Why not a torch.Generator per request: a stateful stream makes a token depend on how many numbers were drawn
before it, so batching, preemption, retries on another worker or a different number of drafts would change the
output. Hashing the coordinates instead gives the same number for the same token wherever and however it is
computed, and never touches the global torch RNG.

The hash is splitmix64's finaliser, chained over the coordinates, in int64 torch ops so it runs vectorised on any
device. Two int64 facts it relies on: multiplication wraps modulo 2**64, and `>>` is arithmetic, so a logical
shift masks off the copied sign bits. kernels/noise.py is the same hash in Triton; the constants and the Purpose
values live in kernels/constants.py, which both import. On the CPU the per-row keys and the race's streams are
hashed in numpy's uint64 arithmetic instead, a few keys and width-less numbers in Python's integers (`_key_on_host`,
`host_uniform_into`, `_uniform_on_host`: the same bits in fewer, cheaper calls).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import Tensor

from kernels import constants
from kernels.constants import UNIFORM_BITS, Purpose


def _to_int64(value: int) -> int:
    """The int64 with the same low 64 bits as a Python int (what int64 tensor arithmetic would give)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


# splitmix64's constants (kernels/constants.py, shared with the kernels) as the int64s with the same bits.
GOLDEN_GAMMA = _to_int64(constants.GOLDEN_GAMMA)
MIX_MUL_1 = _to_int64(constants.MIX_MUL_1)
MIX_MUL_2 = _to_int64(constants.MIX_MUL_2)
_UNIFORM_SCALE = 2.0**-UNIFORM_BITS
_MASK64 = (1 << 64) - 1
_HOST_GAMMA, _HOST_MUL_1, _HOST_MUL_2 = (
    np.uint64(c & _MASK64) for c in (constants.GOLDEN_GAMMA, constants.MIX_MUL_1, constants.MIX_MUL_2)
)
_HOST_MUL_1_INT, _HOST_MUL_2_INT = constants.MIX_MUL_1 & _MASK64, constants.MIX_MUL_2 & _MASK64
PYTHON_KEY_ROWS = 4  # up to this many rows, keys are hashed in Python's integers (measured crossover: ~8 rows)


def _shift_right_into(x: Tensor, bits: int, out: Tensor) -> Tensor:
    """Logical right shift of int64 bit patterns, written into out (x's shape and dtype)."""
    torch.bitwise_right_shift(x, bits, out=out)
    out &= (1 << (64 - bits)) - 1  # `>>` copies the sign bit: mask it off
    return out


def mix64(x: Tensor) -> Tensor:
    """splitmix64's finaliser on int64 tensors: a bijection of 64-bit patterns with good avalanche."""
    return mix64_(x.clone(), torch.empty_like(x))


def mix64_(x: Tensor, scratch: Tensor) -> Tensor:
    """mix64 in place; scratch (x's shape and dtype) holds the shifted copies, so nothing is allocated."""
    for bits, multiplier in ((30, MIX_MUL_1), (27, MIX_MUL_2), (31, None)):
        x ^= _shift_right_into(x, bits, scratch)
        if multiplier is not None:
            x *= multiplier
    return x


def _key(seeds: Tensor, positions: Tensor, purpose: Purpose) -> Tensor:
    """One 64-bit key per (seed, position, purpose). Each stage is a bijection of the coordinate it adds."""
    if seeds.device.type == "cpu":
        return _key_on_host(seeds, positions, purpose)
    key = mix64(seeds + GOLDEN_GAMMA)
    key = mix64(key ^ positions)
    return mix64(key + _to_int64(int(purpose) * GOLDEN_GAMMA))


def _mix64_host(x: np.ndarray, scratch: np.ndarray | None = None) -> np.ndarray:
    """mix64 on uint64 numpy arrays, in place, where multiplication wraps and `>>` is logical: the same bits.
    scratch (x's shape): holds the shifted copies, so that nothing is allocated."""
    for bits, multiplier in ((30, _HOST_MUL_1), (27, _HOST_MUL_2), (31, None)):
        x ^= np.right_shift(x, np.uint64(bits), out=scratch)
        if multiplier is not None:
            x *= multiplier
    return x


def _mix64_int(x: int) -> int:
    """mix64 on one 64-bit pattern held as a non-negative Python int."""
    x ^= x >> 30
    x = (x * _HOST_MUL_1_INT) & _MASK64
    x ^= x >> 27
    x = (x * _HOST_MUL_2_INT) & _MASK64
    return x ^ (x >> 31)


def _key_on_host(seeds: Tensor, positions: Tensor, purpose: Purpose) -> Tensor:
    """`_key` for CPU tensors in numpy's uint64 arithmetic: the same bits in ~15 array ops instead of ~40 torch ones
    (three mix64 chains over a handful of rows are a measurable share of a CPU sampling step); a few rows, in
    Python's integers, where each numpy call would cost more than a row's whole chain."""
    if len(seeds) <= PYTHON_KEY_ROWS:
        offset = int(purpose) * constants.GOLDEN_GAMMA
        keys = [
            _mix64_int((_mix64_int(_mix64_int((seed + constants.GOLDEN_GAMMA) & _MASK64) ^ (position & _MASK64))
                        + offset) & _MASK64)
            for seed, position in zip(seeds.tolist(), positions.tolist())
        ]
        return torch.tensor([_to_int64(k) for k in keys], dtype=torch.int64)
    key = seeds.numpy().astype(np.uint64) + _HOST_GAMMA
    key = _mix64_host(key)
    key ^= positions.numpy().astype(np.uint64)
    key = _mix64_host(key)
    key += np.uint64(int(purpose) * constants.GOLDEN_GAMMA & _MASK64)
    return torch.from_numpy(_mix64_host(key).view(np.int64))


def _to_unit_interval(bits: Tensor) -> Tensor:
    out = torch.empty(bits.shape, dtype=torch.float64, device=bits.device)
    return _to_unit_interval_into(bits, torch.empty_like(bits), out)


def _to_unit_interval_into(bits: Tensor, scratch: Tensor, out: Tensor) -> Tensor:
    """The top UNIFORM_BITS of each pattern as a float64 strictly inside (0, 1), written into out (float64), with
    scratch (bits' shape and dtype) as working memory."""
    out.copy_(_shift_right_into(bits, 64 - UNIFORM_BITS, scratch))
    out += 0.5
    out *= _UNIFORM_SCALE
    return out


def uniform(seeds: Tensor, positions: Tensor, purpose: Purpose, width: int | None = None) -> Tensor:
    """Uniform float64 numbers strictly inside (0, 1): [B] when width is None, else [B, width].

    With a width, row b is the first `width` numbers of the splitmix64 stream keyed by
    (seeds[b], positions[b], purpose): one per vocabulary entry for exponential-race sampling.
    """
    if seeds.shape != positions.shape or seeds.dim() != 1:
        raise ValueError(f"seeds {tuple(seeds.shape)} and positions {tuple(positions.shape)} must be equal 1-d shapes")
    if seeds.dtype != torch.int64 or positions.dtype != torch.int64:
        raise TypeError(f"seeds and positions must be int64, got {seeds.dtype} and {positions.dtype}")
    key = _key(seeds, positions, purpose)
    if width is None:
        if seeds.device.type == "cpu":
            return _uniform_on_host(key)
        return _to_unit_interval(mix64(key + GOLDEN_GAMMA))
    return _to_unit_interval(mix64(key.unsqueeze(1) + _counters(width, seeds.device)))


def _uniform_on_host(key: Tensor) -> Tensor:
    """uniform's width-less numbers from CPU keys: in Python's integers for a few rows (a verify step's acceptance
    tests, three or four of them, took ~100 us in torch ops), in numpy's uint64 arithmetic for more; the same bits,
    since int -> float64 -> + 0.5 -> * 2**-UNIFORM_BITS rounds alike in every IEEE double arithmetic."""
    shift = 64 - UNIFORM_BITS
    if len(key) <= PYTHON_KEY_ROWS:
        gamma = constants.GOLDEN_GAMMA & _MASK64
        units = [(float(_mix64_int((k + gamma) & _MASK64) >> shift) + 0.5) * _UNIFORM_SCALE
                 for k in key.numpy().view(np.uint64).tolist()]
        return torch.tensor(units, dtype=torch.float64)
    stream = np.right_shift(_mix64_host(key.numpy().view(np.uint64) + _HOST_GAMMA), np.uint64(shift))
    return torch.from_numpy(_unit_interval_into_host(stream, np.empty(stream.shape, dtype=np.float64)))


def host_keys(seeds: Tensor, positions: Tensor, purpose: Purpose) -> np.ndarray:
    """The keys of CPU seeds and positions as uint64 numpy [B]: host_uniform_into's input."""
    return _key_on_host(seeds, positions, purpose).numpy().view(np.uint64)


def host_uniform_into(keys: np.ndarray, out: np.ndarray, stream: np.ndarray, scratch: np.ndarray) -> np.ndarray:
    """uniform(seeds, positions, purpose, width) written into out (float64 [B, width]) from the keys of host_keys,
    in numpy's uint64 arithmetic with stream and scratch (uint64 [B, width]) as working memory: in place, for the CPU
    race's buffers small enough to stay in cache; the same bits, each call a third of a torch op's cost (one
    4,096-token row: ~50 -> ~20 us)."""
    np.add(_host_counters(out.shape[1]), keys[:, None], out=stream)
    np.right_shift(_mix64_host(stream, scratch), np.uint64(64 - UNIFORM_BITS), out=stream)
    return _unit_interval_into_host(stream, out)


def _unit_interval_into_host(bits: np.ndarray, out: np.ndarray) -> np.ndarray:
    """_to_unit_interval_into's arithmetic in numpy, from the top UNIFORM_BITS already shifted down (uint64) into
    out (float64, bits' shape)."""
    out[...] = bits
    out += 0.5
    out *= _UNIFORM_SCALE
    return out


@functools.lru_cache(maxsize=16)
def _host_counters(width: int) -> np.ndarray:
    """_counters' values as uint64 on the host."""
    return _counters(width, torch.device("cpu")).numpy().view(np.uint64)


@functools.lru_cache(maxsize=16)
def _counters(width: int, device: torch.device) -> Tensor:
    """[width] the stream's counters 1..width, each times the golden gamma (wrapping as int64 does); the same for
    every call of a width, so made once (callers only read it)."""
    return torch.arange(1, width + 1, dtype=torch.int64, device=device) * GOLDEN_GAMMA
