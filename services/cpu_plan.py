"""Which CPUs each worker's engine computes on, with how many torch threads, and where the rest of the mesh runs:
chosen from the machine (services/cpu_budget.py) unless `--engine-cpus` or `--torch-threads` say otherwise.

The rule, for the CPU device:
- The mesh's cores (one, and one more per `WORKERS_PER_MESH_CORE` workers) are left to the processes that are not
  engines: NATS, the gateway, the detokenizers and the workers' event loops. Every other core goes to the engines,
  shared out evenly, each engine pinned to its own CPUs with one torch thread per CPU (at most
  `MAX_ENGINE_THREADS`; cores beyond that go to the rest of the mesh, which seldom needs them).
- An engine that must wait for a core loses its whole step: torch's OpenMP threads meet at a barrier after every
  operator, so one preempted thread stalls the others, which spin while they wait. Measured on a 2-core machine
  with torch's default of one thread per core, under aiperf: 38-41 ms between tokens at one stream and 282 ms at
  eight, against 4.2 and 10.9 ms with the engine on one core and the mesh on the other.
- Where a cgroup limit allows less time than the CPUs in the mask (a container's CPU limit), the engines are not
  pinned: the mask's CPUs are shared with other containers, so no CPU is ours to reserve. Thread counts still
  come from the limit.
- With fewer cores than engines plus the mesh's cores, nothing is pinned and each engine runs one thread: the
  kernel spreads the processes over the cores better than a fixed placement of more processes than cores.
On CUDA the engine's host side is one Python thread queueing kernels: nothing is pinned, and torch's threads are
left as they are unless a cgroup limit says how many cores there are.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from services.cpu_affinity import CPU_LIST_HELP, format_cpu_list, parse_cpu_list
from services.cpu_budget import CpuBudget
from services.startup_checks import UsageError

AUTO, UNPINNED = "auto", "none"
EngineCpusOption = frozenset[int] | Literal["auto", "none"]
ENGINE_CPUS_HELP = (
    f"the CPUs the workers' engines compute on ({CPU_LIST_HELP}); every other process of the mesh runs on the "
    f"rest. {AUTO!r}: chosen from the CPUs this process may use and its cgroup's CPU limit (README: CPU "
    f"placement); {UNPINNED!r}: wherever the kernel puts them"
)
OMP_THREADS_ENV = "OMP_NUM_THREADS"  # torch's own setting: whoever set it meant it, so it counts as --torch-threads
TORCH_THREADS_HELP = (
    f"torch threads per engine (default 0: ${OMP_THREADS_ENV} if set, else one per engine CPU as --engine-cpus "
    "chooses them)"
)
PLAN_LINE = "specmesh: CPUs: "  # starts the line where `specmesh up` prints its plan (mesh_process.Mesh reads it)
CPU_LIST_CHARACTERS = frozenset("0123456789,- ")
WORKERS_PER_MESH_CORE = 4
# An engine's threads meet at a barrier after every operator; beyond a point, more threads add waiting and no
# speed for decode-sized matrices. Not measured here (this machine has two cores): a bound on waste, not a tuning.
MAX_ENGINE_THREADS = 16


def engine_cpus_option(text: str) -> EngineCpusOption:
    """--engine-cpus: auto, none, or a CPU list (an argparse type: a bad list is a one-line usage error)."""
    if text in (AUTO, UNPINNED):
        return text  # type: ignore[return-value]
    if not text or not set(text) <= CPU_LIST_CHARACTERS:
        raise argparse.ArgumentTypeError(f"{text!r} is not {AUTO!r}, {UNPINNED!r} or a CPU list ({CPU_LIST_HELP})")
    return parse_cpu_list(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine-cpus", type=engine_cpus_option, default=AUTO, help=ENGINE_CPUS_HELP)
    parser.add_argument("--torch-threads", type=int, default=0, help=TORCH_THREADS_HELP)


@dataclass(frozen=True)
class CpuPlan:
    """Per worker, its engine's CPUs (None: not pinned); torch threads per engine (0: torch's own choice); the
    CPUs of every process that is not an engine (None: not pinned); and why, for the start-up log."""

    engine_cpus: tuple[frozenset[int] | None, ...]
    torch_threads: int
    rest_cpus: frozenset[int] | None
    reason: str

    def __post_init__(self) -> None:
        if self.torch_threads < 0:
            raise UsageError(f"--torch-threads {self.torch_threads}: must be 0 (automatic) or more")

    def describe(self) -> str:
        """One line for the start-up log: where the engines and the rest run, and why."""
        engines = _plural(len(self.engine_cpus), "engine")
        threads = "torch's own threads" if self.torch_threads == 0 else _plural(self.torch_threads, "torch thread")
        pinned = [format_cpu_list(cpus) for cpus in self.engine_cpus if cpus is not None]
        where = f"on CPUs {' | '.join(pinned)}" if pinned else "not pinned"
        rest = "" if self.rest_cpus is None else f"; the rest of the mesh on CPUs {format_cpu_list(self.rest_cpus)}"
        return f"{engines} {where}, {threads} each{rest} ({self.reason})"

    def worker_cpus(self, worker: int) -> frozenset[int] | None:
        """Where worker `worker`'s process may run: its event loop on the rest, its engine on its own CPUs."""
        engine = self.engine_cpus[worker]
        if engine is None or self.rest_cpus is None:
            return None
        return engine | self.rest_cpus


def plan_for(args: argparse.Namespace, workers: int) -> CpuPlan:
    """The plan for a command's --device, --engine-cpus and --torch-threads on this process's CPU budget."""
    threads = requested_threads(args.torch_threads, os.environ)
    return plan_cpus(CpuBudget.of_this_process(), workers, args.device, args.engine_cpus, threads)


def requested_threads(option: int, environ: Mapping[str, str]) -> int:
    """--torch-threads if given, else $OMP_NUM_THREADS (its first level, as OpenMP reads "4,2"), else 0 (the
    plan's choice)."""
    text = environ.get(OMP_THREADS_ENV, "").strip()
    if option or not text:
        return option
    try:
        threads = int(text.split(",")[0])
    except ValueError:
        threads = 0
    if threads < 1:
        raise UsageError(f"{OMP_THREADS_ENV}={text!r} is not a thread count")
    return threads


def plan_cpus(
    budget: CpuBudget, workers: int, device: str, engine_cpus: EngineCpusOption = AUTO, torch_threads: int = 0
) -> CpuPlan:
    """The placement of `workers` engines and the rest of the mesh; explicit options win over the machine's."""
    if workers < 1:
        raise UsageError(f"--workers {workers}: at least one worker is needed")
    unpinned = (None,) * workers
    if engine_cpus == UNPINNED:
        return CpuPlan(unpinned, torch_threads, None, "--engine-cpus none")
    if isinstance(engine_cpus, frozenset):
        rest = budget.cpus - engine_cpus
        if not rest:
            raise UsageError(f"--engine-cpus {format_cpu_list(engine_cpus)} leaves no CPU for the rest of the mesh")
        shares, per_engine = _share_out(sorted(engine_cpus), workers)
        rest = budget.cpus - frozenset().union(*shares)  # a list that does not divide evenly leaves some over
        return CpuPlan(shares, torch_threads or per_engine, rest, "--engine-cpus")
    if not device.startswith("cpu"):
        threads = torch_threads or (budget.cores if budget.limit is not None else 0)
        return CpuPlan(unpinned, threads, None, f"{device}: the engine's host side is one thread")
    mesh_cores = 1 + workers // WORKERS_PER_MESH_CORE
    engine_cores = budget.cores - mesh_cores
    if engine_cores < workers:
        reason = f"{budget.describe()}: fewer than {workers} engine cores beside {mesh_cores} for the rest"
        return CpuPlan(unpinned, torch_threads or 1, None, reason)
    per_engine = min(engine_cores // workers, MAX_ENGINE_THREADS)
    if not budget.owns_its_cpus:
        return CpuPlan(unpinned, torch_threads or per_engine, None, f"{budget.describe()}: CPUs shared, not pinned")
    cpus = sorted(budget.cpus)
    shares, _ = _share_out(cpus[: per_engine * workers], workers)
    rest = frozenset(cpus) - frozenset().union(*shares)
    return CpuPlan(shares, torch_threads or per_engine, rest, f"auto: {budget.describe()}")


def _share_out(cpus: list[int], workers: int) -> tuple[tuple[frozenset[int], ...], int]:
    """Each worker's share of the engine CPUs and its thread count: disjoint runs where there are enough CPUs,
    else every engine on all of them with one thread."""
    if len(cpus) < workers:
        return (frozenset(cpus),) * workers, 1
    per = len(cpus) // workers
    return tuple(frozenset(cpus[i * per:(i + 1) * per]) for i in range(workers)), per


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"
