"""CPU time a running mesh spends, process by process, while a load generator drives it (Linux: read from /proc).

Under a load generator on the same machine the mesh's processes compete with it for the cores; what each of them
takes per output token says where tokens/s could still come from: the engine's model arithmetic, or the services
around it (gateway, detokenizer, the worker's event loop, NATS). `CpuMeter` snapshots every process of the tree
under `specmesh up` (each named by its role) before and after a load point.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.process_tree import PROC, TICKS_PER_S, command_line, cpu_seconds, descendants

ROLES = (  # (a piece of the command line, the role): first match wins
    ("nats-server", "nats"),
    ("services.cli gateway", "gateway"),
    ("services.cli detokenizer", "detokenizer"),
    ("services.cli worker", "worker loop"),
    ("multiprocessing.spawn", "engine"),  # the worker's engine process and its tensor-parallel ranks
    ("services.cli up", "launcher"),
    ("specmesh up", "launcher"),
)
OTHER = "other"
OUTSIDE = "outside the mesh"  # every other process of the machine: the load generator, chiefly
# /proc/stat's first line: user nice system idle iowait irq softirq steal ...; busy: user to softirq, less idle and
# iowait (steal is time the hypervisor gave another machine)
BUSY_FIELDS = (0, 1, 2, 5, 6)


def role_of(cmdline: str) -> str:
    """The mesh role of a process from its command line (arguments joined by spaces)."""
    return next((role for piece, role in ROLES if piece in cmdline), OTHER)


def machine_cpu_seconds() -> float:
    """CPU seconds every process of the machine has been busy so far, all CPUs together."""
    ticks = [int(field) for field in (PROC / "stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(ticks[i] for i in BUSY_FIELDS) / TICKS_PER_S


@dataclass
class CpuMeter:
    """CPU seconds by role of the process tree under `root_pid` between `start` and `stop`, and OUTSIDE: the rest of
    the machine's. A process that ends in between is not counted (its time goes to OUTSIDE); one that starts in
    between counts from zero."""

    root_pid: int

    def start(self) -> None:
        self._machine = machine_cpu_seconds()
        self._before = self._snapshot()

    def stop(self) -> dict[str, float]:
        after, by_role = self._snapshot(), {}
        machine = machine_cpu_seconds() - self._machine
        for pid, (role, seconds) in after.items():
            before = self._before.get(pid, (role, 0.0))[1]
            by_role[role] = by_role.get(role, 0.0) + seconds - before
        by_role[OUTSIDE] = max(machine - sum(by_role.values()), 0.0)
        return by_role

    def _snapshot(self) -> dict[int, tuple[str, float]]:
        snapshot = {}
        tree = {self.root_pid: command_line(self.root_pid)} | descendants(self.root_pid)
        for pid, cmdline in tree.items():
            seconds = cpu_seconds(pid)
            if seconds is not None:
                snapshot[pid] = (role_of(cmdline), seconds)
        return snapshot
