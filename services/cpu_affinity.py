"""Pinning processes to CPUs, and CPU lists as Linux writes them (`--engine-cpus`; the plan: cpu_plan.py).

On a small CPU machine the engine and the mesh's other processes (NATS, gateway, detokenizer, the worker's event
loop) share few cores. Left to the kernel, a process woken to publish a step's frames is often placed on the core
the engine runs on and preempts it (measured with `python -m benchmarks.speculation --streams 1`: the engine's
write of a step's result took ~170 us instead of ~80, and the mesh kept 0.62 of the in-process engine instead of
0.86). Pinning the engine to its CPUs and everything else to the others keeps the engine's core its own, as vLLM's
CPU backend binds its OpenMP threads and reserves CPUs for the front end.
"""

from __future__ import annotations

import argparse
import os

CPU_LIST_HELP = "CPUs as Linux writes them: 0-3,6"


def parse_cpu_list(text: str) -> frozenset[int]:
    """A Linux CPU list ("0-3,6") as a set; an argparse type, so a bad list is a one-line usage error."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            low, high = int(first), int(last or first)
            if low < 0 or high < low:
                raise ValueError
            cpus.update(range(low, high + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a CPU list ({CPU_LIST_HELP})") from None
    usable = os.sched_getaffinity(0)
    if not cpus <= usable:
        raise argparse.ArgumentTypeError(
            f"CPUs {format_cpu_list(cpus - usable)} are not among this process's CPUs {format_cpu_list(usable)}"
        )
    return frozenset(cpus)


def pin(cpus: frozenset[int] | None) -> None:
    """Runs this process (and the threads and processes it starts from now on) on these CPUs; None: leave it."""
    if cpus is not None:
        os.sched_setaffinity(0, cpus)


def format_cpu_list(cpus: set[int] | frozenset[int]) -> str:
    """The set as a CPU list that parse_cpu_list reads back, runs written as ranges ("0-4,7")."""
    terms: list[str] = []
    ordered = sorted(cpus)
    start = 0
    for i, cpu in enumerate(ordered):
        if i + 1 == len(ordered) or ordered[i + 1] != cpu + 1:
            first = ordered[start]
            terms.append(str(first) if first == cpu else f"{first}-{cpu}")
            start = i + 1
    return ",".join(terms)
