"""The values the Triton kernels and their torch twins must agree on, in one place that imports neither triton nor
the worker: the worker's twins (services/worker/sampling/, drafting/) and the kernels both import them from here,
so the kernels never need the worker and CPU callers never need triton.
"""

from __future__ import annotations

import enum

# splitmix64 (sampling/random.py in int64 torch ops, kernels/noise.py in uint64), as published: unsigned 64-bit.
GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # the stream increment (2**64 / golden ratio, odd)
MIX_MUL_1 = 0xBF58476D1CE4E5B9  # the finaliser's first multiplier
MIX_MUL_2 = 0x94D049BB133111EB  # the finaliser's second multiplier
UNIFORM_BITS = 52  # a float64 holds 52 bits below 1 exactly, so (k + 0.5) / 2**52 is never 0 and never rounds to 1


class Purpose(enum.IntEnum):
    """What a random number is for: each purpose draws independent noise at the same (seed, position)."""

    SAMPLE = 1  # the token emitted at a position (plain decoding, and the bonus/recovered token of a verify step)
    ACCEPT = 2  # the acceptance test of the draft at a position
    RECOVER = 3  # reserved for a sampler that needs noise of its own after a rejection
    DRAFT = 4  # a draft model sampling its proposal for a position


PAD_TOKEN = -1  # fills token slots past a row's count: drafts past num_drafts, outputs past num_emitted

# The verification strategies and debugging accept policies of sampling/rejection.py, as the codes the fused
# verification kernel is specialised on (keys: the worker's VerifyStrategy and AcceptPolicy names).
VERIFY_STRATEGY_CODES: dict[str, int] = {"rejection": 0, "target_match": 1, "greedy": 2, "topp": 3}
ACCEPT_POLICY_CODES: dict[str, int] = {"normal": 0, "accept_all": 1, "reject_all": 2}
