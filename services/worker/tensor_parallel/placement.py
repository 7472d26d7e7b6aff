"""Where a tensor-parallel group's ranks run on the CPU: the engine's CPUs dealt out among them.

Each rank's passes take as long as the slowest rank's, so the ranks get equal shares: the CPUs the engine process
was given (its affinity, services/cpu_plan.py) split into runs, each rank pinned to its run, and the engine's torch
threads divided among the ranks (at least one each). With fewer CPUs than ranks the ranks share them.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np


def rank_cpus(cpus: Collection[int], size: int) -> list[frozenset[int]]:
    """`size` shares of `cpus`: equal runs in CPU order, or, with fewer CPUs than ranks, one CPU each in turn."""
    ordered = sorted(cpus)
    if len(ordered) >= size:
        return [frozenset(int(cpu) for cpu in run) for run in np.array_split(ordered, size)]
    return [frozenset({ordered[rank % len(ordered)]}) for rank in range(size)]


def rank_threads(engine_threads: int, size: int) -> int:
    return max(1, engine_threads // size)
