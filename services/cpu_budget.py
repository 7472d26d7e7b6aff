"""How much CPU this process may use: the CPUs it may run on (`os.sched_getaffinity`) and, in a container, the
CPU limit its cgroup sets (Kubernetes' `resources.limits.cpu`, Docker's `--cpus`), which torch does not read.

A limit of 2 CPUs on a 16-core host leaves 16 CPUs in the affinity mask but only 2 CPUs' worth of time each
period; sixteen torch threads then spend most of it waiting for each other.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

PROC_CGROUP = Path("/proc/self/cgroup")
PROC_MOUNTINFO = Path("/proc/self/mountinfo")
CGROUP2_LIMIT_FILE = "cpu.max"  # "<quota> <period>" or "max <period>"
CGROUP1_QUOTA_FILE, CGROUP1_PERIOD_FILE = "cpu.cfs_quota_us", "cpu.cfs_period_us"  # quota -1: no limit
NO_LIMIT_V2 = "max"


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
    `cpu.cfs_quota_us` / `cpu.cfs_period_us`); None where no limit is set or cgroups cannot be read."""
    try:
        memberships = proc_cgroup.read_text().splitlines()
        mounts = mountinfo.read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in memberships:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            mount = _mount_point(mounts, "cgroup2", None)
            reader = _v2_limit
        elif "cpu" in controllers.split(","):
            mount = _mount_point(mounts, "cgroup", "cpu")
            reader = _v1_limit
        else:
            continue
        if mount is None:
            continue
        limits += [limit for d in _ancestors(mount, path) if (limit := reader(d)) is not None]
    return min(limits, default=None)


def _mount_point(mounts: list[str], fs_type: str, controller: str | None) -> Path | None:
    """Where a cgroup hierarchy is mounted (mountinfo: fields, " - ", type, source, super options)."""
    for line in mounts:
        fields, _, tail = line.partition(" - ")
        kind, _, options = tail.split(" ")[:3] if tail.count(" ") >= 2 else (tail, "", "")
        if kind != fs_type:
            continue
        if controller is None or controller in options.split(","):
            return Path(fields.split(" ")[4])
    return None


def _ancestors(mount: Path, path: str) -> list[Path]:
    """The cgroup's directory and its parents up to the mount point: a parent's limit binds its children too."""
    here = mount / path.lstrip("/")
    chain = [here, *here.parents]
    return [d for d in chain if d == mount or mount in d.parents]


def _v2_limit(directory: Path) -> float | None:
    try:
        quota, period = (directory / CGROUP2_LIMIT_FILE).read_text().split()
    except (OSError, ValueError):
        return None
    return None if quota == NO_LIMIT_V2 else int(quota) / int(period)


def _v1_limit(directory: Path) -> float | None:
    try:
        quota = int((directory / CGROUP1_QUOTA_FILE).read_text())
        period = int((directory / CGROUP1_PERIOD_FILE).read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period
