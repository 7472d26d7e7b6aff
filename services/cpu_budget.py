"""How much CPU this process may use: the CPUs it may run on (`os.sched_getaffinity`) and, in a container, the
CPU limit its cgroup sets (Kubernetes' `resources.limits.cpu`, Docker's `--cpus`), which torch does not read. The
same walk over the process's cgroup and its ancestors reads the memory its cgroup has left (the KV cache's budget,
services/worker/engine/kv_budget.py).

A limit of 2 CPUs on a 16-core host leaves 16 CPUs in the affinity mask but only 2 CPUs' worth of time each
period; sixteen torch threads then spend most of it waiting for each other.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PROC_CGROUP = Path("/proc/self/cgroup")
PROC_MOUNTINFO = Path("/proc/self/mountinfo")
CGROUP2_LIMIT_FILE = "cpu.max"  # "<quota> <period>" or "max <period>"
CGROUP1_QUOTA_FILE, CGROUP1_PERIOD_FILE = "cpu.cfs_quota_us", "cpu.cfs_period_us"  # quota -1: no limit
NO_LIMIT_V2 = "max"
CGROUP2_MEMORY_FILES = ("memory.max", "memory.current")  # limit ("max": none) and usage, in bytes
CGROUP1_MEMORY_FILES = ("memory.limit_in_bytes", "memory.usage_in_bytes")
CGROUP1_NO_MEMORY_LIMIT = 1 << 62  # v1 writes a huge page-rounded number (9223372036854771712) for no limit


@dataclass(frozen=True)
class CpuBudget:
    """The CPUs this process may run on, and the CPU time its cgroup allows (in CPUs; None: no limit)."""

    cpus: frozenset[int]
    limit: float | None = None

    def __post_init__(self) -> None:
        if not self.cpus:
            raise ValueError("a CPU budget needs at least one CPU")
        if self.limit is not None and self.limit <= 0:
            raise ValueError(f"a CPU limit must be positive, not {self.limit}")

    @property
    def cores(self) -> int:
        """Whole cores' worth of time: the smaller of the CPUs and the limit rounded down, at least one."""
        if self.limit is None:
            return len(self.cpus)
        return max(1, min(len(self.cpus), math.floor(self.limit)))

    @property
    def owns_its_cpus(self) -> bool:
        """Whether every CPU in the mask is ours to fill: pinning to a CPU helps only when no limit makes the
        process share the mask's CPUs with other containers."""
        return self.limit is None or self.limit >= len(self.cpus)

    def describe(self) -> str:
        limit = "no cgroup CPU limit" if self.limit is None else f"cgroup CPU limit {self.limit:g}"
        return f"{len(self.cpus)} CPUs, {limit}"

    @classmethod
    def of_this_process(cls) -> CpuBudget:
        return cls(frozenset(os.sched_getaffinity(0)), cgroup_cpu_limit())


def cgroup_cpu_limit(proc_cgroup: Path = PROC_CGROUP, mountinfo: Path = PROC_MOUNTINFO) -> float | None:
    """The tightest CPU limit on this process's cgroup and its ancestors, in CPUs (cgroup v2 `cpu.max`, else v1
    `cpu.cfs_quota_us` / `cpu.cfs_period_us`); None where no limit is set or cgroups cannot be read. Anything it
    cannot parse counts as no limit: an unusual /proc must never stop a service from starting."""
    return _tightest(proc_cgroup, mountinfo, "cpu", _v2_limit, _v1_limit)


def cgroup_memory_headroom(proc_cgroup: Path = PROC_CGROUP, mountinfo: Path = PROC_MOUNTINFO) -> int | None:
    """The fewest bytes any of this process's cgroup and its ancestors may still allocate (limit less usage: v2
    `memory.max` / `memory.current`, else v1 `memory.limit_in_bytes` / `memory.usage_in_bytes`); None where no
    limit is set or cgroups cannot be read, as for the CPU limit."""
    return _tightest(proc_cgroup, mountinfo, "memory", _v2_memory, _v1_memory)


def _tightest(
    proc_cgroup: Path, mountinfo: Path, controller: str, v2_reader: Callable[[Path], float | None],
    v1_reader: Callable[[Path], float | None],
) -> float | None:
    """The smallest value a reader finds in this process's cgroup directories of `controller` and their ancestors."""
    try:
        memberships = proc_cgroup.read_text(errors="surrogateescape").splitlines()
        mount_lines = mountinfo.read_text(errors="surrogateescape").splitlines()
    except OSError:
        return None
    mounts = [mount for line in mount_lines if (mount := _Mount.parse(line)) is not None]
    limits = []
    for line in memberships:
        parts = line.split(":", 2)  # "hierarchy-id:controllers:path"
        if len(parts) < 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            mount, reader = _find(mounts, "cgroup2", None), v2_reader
        elif controller in controllers.split(","):
            mount, reader = _find(mounts, "cgroup", controller), v1_reader
        else:
            continue
        if mount is not None:
            limits += [limit for d in mount.ancestors(path) if (limit := reader(d)) is not None]
    return min(limits, default=None)


@dataclass(frozen=True)
class _Mount:
    """One line of /proc/self/mountinfo: "id parent major:minor root mount-point options [optional...] - type
    source super-options"."""

    root: str
    point: Path
    fs_type: str
    super_options: tuple[str, ...]

    @classmethod
    def parse(cls, line: str) -> _Mount | None:
        """None for a line of another shape."""
        fields, separator, tail = line.partition(" - ")
        fields, tail = fields.split(), tail.split()
        if not separator or len(fields) < 5 or not tail:
            return None
        return cls(fields[3], Path(fields[4]), tail[0], tuple(tail[2].split(",")) if len(tail) > 2 else ())

    def ancestors(self, path: str) -> list[Path]:
        """The cgroup's directory and its parents up to the mount point (a parent's limit binds its children).
        A container's hierarchy is often mounted at its own cgroup (root /docker/<id>), so that prefix of the
        cgroup's path is the mount point itself."""
        relative = path[len(self.root):] if path.startswith(self.root) and self.root != "/" else path
        here = self.point / relative.lstrip("/")
        return [d for d in (here, *here.parents) if d == self.point or self.point in d.parents]


def _find(mounts: list[_Mount], fs_type: str, controller: str | None) -> _Mount | None:
    return next((m for m in mounts if m.fs_type == fs_type and (controller is None or controller in m.super_options)),
                None)


def _v2_limit(directory: Path) -> float | None:
    try:
        quota, period = (directory / CGROUP2_LIMIT_FILE).read_text().split()
        return None if quota == NO_LIMIT_V2 else int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _v1_limit(directory: Path) -> float | None:
    try:
        quota = int((directory / CGROUP1_QUOTA_FILE).read_text())
        period = int((directory / CGROUP1_PERIOD_FILE).read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


def _v2_memory(directory: Path) -> int | None:
    try:
        limit, usage = ((directory / name).read_text().strip() for name in CGROUP2_MEMORY_FILES)
        return None if limit == NO_LIMIT_V2 else max(int(limit) - int(usage), 0)
    except (OSError, ValueError):
        return None


def _v1_memory(directory: Path) -> int | None:
    try:
        limit, usage = (int((directory / name).read_text()) for name in CGROUP1_MEMORY_FILES)
    except (OSError, ValueError):
        return None
    return None if limit >= CGROUP1_NO_MEMORY_LIMIT else max(limit - usage, 0)
