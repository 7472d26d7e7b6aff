"""Seeds: the API's int64 range mapped into the worker's, and the seed of each choice of a request.

The worker's counter-based noise (services/worker/sampling/random.py) keys on seeds in [0, 2**63). The API takes
any int64, as vLLM does: `worker_seed` keeps a seed's low 63 bits, so a negative seed s draws what s + 2**63 draws
(2**64 API seeds cannot map one to one onto 2**63 worker seeds).

Choice i of a request runs with `choice_seed(seed, i)`: choice 0 with the request's seed itself, so a request with
n = 1 draws what it always drew, and choice i > 0 with splitmix64's finaliser applied to seed + i * GOLDEN_GAMMA
(the i-th value of splitmix64's stream from that seed), low 63 bits. Any choice can be reproduced alone by sending
its seed with n = 1.
"""

from __future__ import annotations

import random
import secrets

from kernels.constants import GOLDEN_GAMMA, MIX_MUL_1, MIX_MUL_2

SEED_BITS = 63
MAX_WORKER_SEED = (1 << SEED_BITS) - 1  # also the mask that keeps a seed's low 63 bits
MIN_API_SEED = -(1 << 63)  # int64
MAX_API_SEED = (1 << 63) - 1
_U64 = (1 << 64) - 1


def worker_seed(seed: int) -> int:
    """The worker's seed for an API seed in [MIN_API_SEED, MAX_API_SEED]: its low 63 bits."""
    return seed & MAX_WORKER_SEED


def _mix64(x: int) -> int:
    """splitmix64's finaliser on an unsigned 64-bit int (sampling/random.py has it on int64 tensors)."""
    x = ((x ^ (x >> 30)) * MIX_MUL_1) & _U64
    x = ((x ^ (x >> 27)) * MIX_MUL_2) & _U64
    return x ^ (x >> 31)


def choice_seed(seed: int, choice: int) -> int:
    """The seed choice `choice` of a request seeded `seed` (a worker seed) samples with."""
    if choice == 0:
        return seed
    return _mix64((seed + choice * GOLDEN_GAMMA) & _U64) & MAX_WORKER_SEED


class SeedDraw:
    """The seeds of sampled requests that name none, fixed where a request enters the mesh so that every worker that
    runs it draws the same tokens. Without a server seed they come from the OS's entropy; with one (vLLM's `--seed`)
    from a stream it starts, so the same sequence of such requests sent to a freshly started server draws the same
    seeds, and the same tokens."""

    def __init__(self, seed: int | None = None) -> None:
        self._stream = None if seed is None else random.Random(seed)

    def draw(self) -> int:
        """The next seed, a worker seed (in [0, 2**63))."""
        if self._stream is None:
            return secrets.randbits(SEED_BITS)
        return self._stream.getrandbits(SEED_BITS)
