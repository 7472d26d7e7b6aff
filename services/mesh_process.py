"""Starts the real mesh (`specmesh up`: NATS, gateway, worker, detokenizer as processes) from Python,
for end-to-end tests and benchmarks."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from services.cpu_plan import PLAN_LINE
from services.process_tree import descendants
from shared.config import DEFAULT_MODEL_DIR
from shared.nats_credentials import NatsCredentials, credentials_file
from shared.nats_roles import NatsRole
from shared.nats_server import credentials_dir
from shared.ports import free_port
from shared.nats_settings import NatsSettings

START_TIMEOUT_S = 180.0
SERVED_NAME_OPTION = "--served-model-name"
STOP_TIMEOUT_S = 30.0


@dataclass
class Mesh:
    proc: subprocess.Popen
    base_url: str  # http://host:port/v1
    nats_url: str
    model: str
    log: list[str]
    nats_store_dir: Path

    def nats_settings(self, role: NatsRole) -> NatsSettings:
        """How to reach the mesh's NATS as `role`, with the credentials `specmesh up` generated for it."""
        credentials = NatsCredentials.from_file(credentials_file(credentials_dir(self.nats_store_dir), role))
        return NatsSettings(url=self.nats_url, role=role, credentials=credentials)

    @property
    def metrics_urls(self) -> dict[str, str]:
        """Each service's /metrics, by the name `specmesh up` printed for it (worker-0, detokenizer, ...)."""
        urls = {}
        for line in self.log:
            name, _, url = line.strip().removeprefix("metrics of ").partition(": ")
            if line.strip().startswith("metrics of ") and url.startswith("http"):
                urls[name] = url.strip()
        return urls

    def children(self) -> dict[int, str]:
        """The processes `specmesh up` runs (and theirs), by pid, with their command lines."""
        return descendants(self.proc.pid)

    @property
    def cpu_plan(self) -> str:
        """Where `specmesh up` said it runs its processes (services/cpu_plan.py's description)."""
        return next(line.removeprefix(PLAN_LINE).strip() for line in self.log if line.startswith(PLAN_LINE))

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=STOP_TIMEOUT_S)


def start_mesh(tmp: Path, *extra: str, model: Path = DEFAULT_MODEL_DIR) -> Mesh:
    port, nats_port = free_port(), free_port()
    store_dir = tmp / "nats"
    cmd = [
        sys.executable, "-m", "services.cli", "up", "--model", str(model), "--port", str(port),
        "--nats-port", str(nats_port), "--nats-store-dir", str(store_dir), "--log-level", "WARNING", *extra,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log: list[str] = []
    ready = threading.Event()

    def pump() -> None:  # keeps the pipe drained for the mesh's whole life
        for line in proc.stdout:
            log.append(line)
            if "specmesh is up" in line:
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready.wait(0.2):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("the mesh did not start:\n" + "".join(log[-40:]))
    served = extra[extra.index(SERVED_NAME_OPTION) + 1] if SERVED_NAME_OPTION in extra else model.name
    return Mesh(proc, f"http://127.0.0.1:{port}/v1", f"nats://127.0.0.1:{nats_port}", served, log, store_dir)
