"""The mesh's processes as benchmarks/soak.py watches them: which pid plays which role, how much memory each holds,
what each service says it still holds for requests (its /metrics), and how to kill one with SIGKILL."""

from __future__ import annotations

import os
import signal
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from services.mesh_process import Mesh

try:
    import psutil
except ImportError:  # psutil comes with the [load] extra; /proc says the same on Linux
    psutil = None

PROC = Path("/proc")
KIB = 1024
METRICS_TIMEOUT_S = 5.0
LAUNCHER = "up"  # the role of `specmesh up` itself
NATS = "nats"
NATS_BINARY = "nats-server"
SERVICE_MODULE = "services.cli"
KILLABLE = ("worker", "detokenizer", NATS)
# Gauges that count what a service holds for requests, by the service's name prefix: all read zero when idle.
HELD = {
    "gateway": (
        "specmesh_gateway_generations_in_flight", "specmesh_gateway_admitted_sequences",
        "specmesh_gateway_admission_waiting",
    ),
    "detokenizer": ("specmesh_detokenizer_active_requests",),
    "worker": (
        "specmesh_worker_running_sequences", "specmesh_worker_waiting_sequences",
        "specmesh_worker_kv_cache_usage_ratio",
    ),
}


def metrics_urls(mesh: Mesh) -> dict[str, str]:
    """Each service's /metrics by its name (gateway, detokenizer[-i], worker-i), as `specmesh up` prints them."""
    prefix = "metrics of "
    return dict(
        line.strip().removeprefix(prefix).split(": ", 1) for line in mesh.log if line.strip().startswith(prefix)
    )


def _option(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv[:-1] else None


def roles(mesh: Mesh, urls: dict[str, str]) -> dict[str, int]:
    """The pid of every process of the mesh by role: `up`, nats and each service by the name it has in `urls`
    (a detokenizer or worker is told apart by the metrics port on its command line)."""
    by_port = {url.rsplit(":", 1)[1].split("/", 1)[0]: name for name, url in urls.items()}
    found = {LAUNCHER: mesh.proc.pid}
    for pid, cmdline in mesh.children().items():
        argv = cmdline.split()
        if argv and Path(argv[0]).name == NATS_BINARY:
            found[NATS] = pid
        elif SERVICE_MODULE in argv:
            service = argv[argv.index(SERVICE_MODULE) + 1]
            port = _option(argv, "--metrics-port")
            found[by_port.get(port, service) if port else service] = pid
    return found


def rss_bytes(pid: int) -> int | None:
    """Resident memory of a process, None once it is gone."""
    if psutil is not None:
        try:
            return psutil.Process(pid).memory_info().rss
        except psutil.NoSuchProcess:
            return None
    try:
        status = (PROC / str(pid) / "status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    vm_rss = [line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")]
    return int(vm_rss[0]) * KIB if vm_rss else None  # a zombie has no VmRSS line


def memory(pids: dict[str, int]) -> dict[str, int | None]:
    return {role: rss_bytes(pid) for role, pid in pids.items()}


def held(urls: dict[str, str]) -> dict[str, float]:
    """Every HELD gauge of every service, summed over its labels, as `<service> <gauge>`; a service that does not
    answer reads as NaN, which is not zero."""
    values = {}
    for service, url in urls.items():
        names = HELD[service.split("-", 1)[0]]
        try:
            with urllib.request.urlopen(url, timeout=METRICS_TIMEOUT_S) as response:
                families = {f.name: f for f in text_string_to_metric_families(response.read().decode())}
        except OSError:
            values |= {f"{service} {name}": float("nan") for name in names}
            continue
        for name in names:
            family = families.get(name)
            values[f"{service} {name}"] = sum(s.value for s in family.samples) if family else float("nan")
    return values


def wait_idle(urls: dict[str, str], timeout_s: float, poll_s: float = 0.2) -> tuple[dict[str, float], float]:
    """Polls every service until each HELD gauge reads zero or the timeout passes: the last values and the
    seconds it took."""
    started = time.monotonic()
    while True:
        values = held(urls)
        if all(v == 0 for v in values.values()) or time.monotonic() - started > timeout_s:
            return values, time.monotonic() - started
        time.sleep(poll_s)


def kill_target(pids: dict[str, int], target: str) -> tuple[str, int]:
    """The role and pid that `--kill target` means: nats, or the first worker or detokenizer."""
    if target not in KILLABLE:
        raise ValueError(f"--kill takes one of {', '.join(KILLABLE)}, got {target!r}")
    role = min(role for role in pids if role.split("-", 1)[0] == target)
    return role, pids[role]


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
