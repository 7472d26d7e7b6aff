"""SIGTERM on real processes: a draining worker finishes its requests, or hands them back to the queue for
another worker, which continues the same output; the process exits on its own."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from shared.nats_roles import NatsRole
from shared.ports import free_port
from tests.natsfixture import NatsServer, running_nats_server
from tests.test_e2e import CODE_PROMPT, E2E_MODEL

pytestmark = pytest.mark.e2e

EXIT_TIMEOUT_S = 30.0
READY_TIMEOUT_S = 120.0
LONG = dict(max_tokens=400, temperature=1.0, seed=99, extra_body={"ignore_eos": True})


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


@pytest.fixture
def parts(tmp_path: Path):
    with running_nats_server(tmp_path / "nats") as nats:
        mesh = Parts(nats)
        yield mesh
        for service in mesh.started:
            service.kill()


def _stream(client: openai.OpenAI):
    return client.completions.create(model=E2E_MODEL.name, prompt=CODE_PROMPT, stream=True, **LONG)


def test_draining_worker_finishes_its_request_and_exits(parts: Parts) -> None:
    worker = parts.start("worker", "--drain-timeout", "60")
    stream = _stream(parts.client)
    text = next(iter(stream)).choices[0].text
    worker.proc.send_signal(signal.SIGTERM)
    text += "".join(c.choices[0].text for c in stream if c.choices)
    assert worker.proc.wait(timeout=EXIT_TIMEOUT_S) == 0
    assert len(text) > 0


def test_worker_that_must_leave_hands_its_request_to_another(parts: Parts) -> None:
    leaving = parts.start("worker", "--drain-timeout", "0", "--worker-id", "1")
    stream = _stream(parts.client)
    chunks = iter(stream)
    text = "".join(next(chunks).choices[0].text for _ in range(5))
    assert leaving.terminate() == 0  # hands the unfinished request back with its progress
    parts.start("worker", "--worker-id", "2")
    text += "".join(c.choices[0].text for c in chunks if c.choices)
    uninterrupted = parts.client.completions.create(model=E2E_MODEL.name, prompt=CODE_PROMPT, **LONG).choices[0].text
    assert text == uninterrupted


def test_draining_gateway_and_detokenizer_finish_the_open_stream(parts: Parts) -> None:
    parts.start("worker")
    stream = _stream(parts.client)
    chunks = iter(stream)
    text = next(chunks).choices[0].text
    for service in (parts.gateway, parts.detokenizer):
        service.proc.send_signal(signal.SIGTERM)
    text += "".join(c.choices[0].text for c in chunks if c.choices)
    for service in (parts.gateway, parts.detokenizer):
        assert service.proc.wait(timeout=EXIT_TIMEOUT_S) == 0
    assert len(text) > 0 and stream.response.is_closed
