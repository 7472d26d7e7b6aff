"""A mesh started service by service, each a real process with its own NATS credentials (as `specmesh up` starts
them): Service runs one, Parts a detokenizer and a gateway with an openai client, workers as a test needs.

Import what a test module uses (`from tests.partsfixture import Parts, Service`).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai

from shared.nats_roles import NatsRole
from shared.ports import free_port
from tests.natsfixture import NatsServer, running_nats_server
from tests.test_e2e import E2E_MODEL

EXIT_TIMEOUT_S = 30.0
READY_TIMEOUT_S = 120.0


class Service:
    def __init__(self, name: str, nats: NatsServer, *extra: str) -> None:
        self.port = free_port()
        port_flag = "--port" if name == "gateway" else "--metrics-port"
        cmd = [sys.executable, "-m", "services.cli", "--log-level", "WARNING", name, "--nats-url", nats.url,
               "--model", str(E2E_MODEL), port_flag, str(self.port), *extra]
        # Each service connects as its own NATS user, with the credentials in its environment as `specmesh up` does.
        self.proc = subprocess.Popen(cmd, env={**os.environ, **nats.credentials[NatsRole(name)].environment()})
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self.ready():
            assert self.proc.poll() is None, f"{name} exited during start-up"
            assert time.monotonic() < deadline, f"{name} not ready after {READY_TIMEOUT_S}s"
            time.sleep(0.2)

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/ready", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def metric(self, name: str, labels: str = "") -> float:
        """The sum of a counter's samples whose labels contain `labels`, from the service's /metrics."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*{re.escape(labels)}[^}}]*\}})? (\S+)$", re.M)
        return sum(float(m.group(2)) for m in pattern.finditer(text))

    def terminate(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=EXIT_TIMEOUT_S)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Parts:
    """A mesh started service by service: a detokenizer and a gateway first, workers as the test needs."""

    def __init__(self, nats: NatsServer) -> None:
        self.nats = nats
        self.started: list[Service] = []
        self.detokenizer = self.start("detokenizer")
        self.gateway = self.start("gateway")
        base_url = f"http://127.0.0.1:{self.gateway.port}/v1"
        self.client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)

    def start(self, name: str, *extra: str) -> Service:
        service = Service(name, self.nats, *extra)
        self.started.append(service)
        return service


@contextmanager
def running_parts(store_dir: Path) -> Iterator[Parts]:
    """NATS (its store in store_dir) with a detokenizer and a gateway; every service started is killed at the end."""
    with running_nats_server(store_dir) as nats:
        parts = Parts(nats)
        try:
            yield parts
        finally:
            for service in parts.started:
                service.kill()
