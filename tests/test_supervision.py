"""`specmesh up` supervises its children, and every command stops what it started: real processes, real signals.

A child killed with SIGKILL is started again and the mesh serves again; SIGTERM to `specmesh up` ends every one of
its processes within five seconds; `specmesh nats` never leaves its nats-server behind; a child that keeps crashing
ends the supervision with a message that names it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from services.mesh_process import Mesh, start_mesh
from services.process_tree import descendants, is_running
from services.supervisor import SIGNALS, STOP_SIGNALS, Child, CrashLoopError, RestartPolicy, StopRequested, Supervisor
from shared.ports import free_port, wait_for_port
from tests.test_e2e import E2E_MODEL

pytestmark = pytest.mark.e2e

API_KEY = "supervision-test-key"
STOP_DEADLINE_S = 5.0  # what `specmesh up` promises for SIGTERM, its own exit included
# A worker restart is ~3 s on an idle 2-core machine; a loaded one is far slower, and this deadline leaves room for
# it, so the restart test runs beside other tests (no `exclusive` mark).
SERVE_AGAIN_DEADLINE_S = 60.0
NATS_START_TIMEOUT_S = 30.0
STREAMS_DECLARED = "streams declared"  # what `specmesh nats` prints once the mesh's streams exist
RETRY_INTERVAL_S = 0.2
REQUEST_TIMEOUT_S = 15.0


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory):
    m = start_mesh(
        tmp_path_factory.mktemp("supervised"), "--api-key", API_KEY, "--max-num-seqs", "2", "--max-model-len", "256",
        "--torch-threads", "1", model=E2E_MODEL,
    )
    yield m
    if m.proc.poll() is None:
        m.stop()


def _pid_of(mesh: Mesh, service: str) -> int:
    [pid] = [pid for pid, cmd in mesh.children().items() if f"services.cli {service} " in cmd]
    return pid


def _serves(client: openai.OpenAI, model: str) -> bool:
    try:
        completion = client.completions.create(model=model, prompt="def", max_tokens=2, temperature=0)
    except (openai.APIConnectionError, openai.APIStatusError, openai.APITimeoutError):
        return False
    return completion.usage.completion_tokens > 0


@pytest.mark.parametrize("service", ["worker", "detokenizer", "gateway"])
def test_a_killed_child_is_restarted_and_the_mesh_serves_again(mesh: Mesh, service: str) -> None:
    client = openai.OpenAI(base_url=mesh.base_url, api_key=API_KEY, max_retries=0, timeout=REQUEST_TIMEOUT_S)
    assert _serves(client, mesh.model)
    victim = _pid_of(mesh, service)
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    while not _serves(client, mesh.model):
        assert mesh.proc.poll() is None, "specmesh up ended:\n" + "".join(mesh.log[-20:])
        assert time.monotonic() - killed < SERVE_AGAIN_DEADLINE_S, "".join(mesh.log[-20:])
        time.sleep(RETRY_INTERVAL_S)
    elapsed = time.monotonic() - killed
    replacement = _pid_of(mesh, service)
    assert replacement != victim and not is_running(victim)
    restarted = [line for line in mesh.log if "restarted as pid" in line and f"pid {replacement} " in line]
    assert restarted, "".join(mesh.log[-20:])
    print(f"{service}: served again {elapsed:.1f}s after kill -9")


def _generating_streams(mesh: Mesh, api_key: str) -> list:
    """Two long streams, each of which has begun generating."""
    client = openai.OpenAI(base_url=mesh.base_url, api_key=api_key, max_retries=0, timeout=REQUEST_TIMEOUT_S)
    streams = [
        client.completions.create(model=mesh.model, prompt="def", max_tokens=200, stream=True,
                                  extra_body={"ignore_eos": True})
        for _ in range(2)
    ]
    for stream in streams:
        next(iter(stream))
    return streams


def _left_running(processes: dict[int, str], since: float) -> dict[int, str]:
    """Those of the processes still running STOP_DEADLINE_S after `since` (sooner when none is)."""
    while any(is_running(pid) for pid in processes) and time.monotonic() - since < STOP_DEADLINE_S:
        time.sleep(0.05)
    return {pid: cmd for pid, cmd in processes.items() if is_running(pid)}


@pytest.mark.exclusive  # bounds a time: alone, not beside another worker's tests (tests/conftest.py)
def test_sigterm_stops_every_process_of_the_mesh_within_five_seconds(mesh: Mesh) -> None:
    """Open streams are told why they end: the gateway ends them with a 503 error event, which cancels their
    requests in the mesh while NATS is still up."""
    processes = mesh.children()
    assert {"worker", "detokenizer", "gateway", "nats-server"} <= {
        name for cmd in processes.values() for name in ("worker", "detokenizer", "gateway", "nats-server") if name in cmd
    }
    streams = _generating_streams(mesh, API_KEY)
    sent = time.monotonic()
    mesh.proc.send_signal(signal.SIGTERM)
    for stream in streams:
        with pytest.raises(openai.APIError, match="shutting down"):
            list(stream)
    assert mesh.proc.wait(timeout=STOP_DEADLINE_S) == 0
    left = _left_running(processes, sent)
    elapsed = time.monotonic() - sent
    assert not left, f"left running after SIGTERM: {left}"
    assert elapsed < STOP_DEADLINE_S
    print(f"specmesh up and its {len(processes)} processes stopped {elapsed:.2f}s after SIGTERM")


@pytest.mark.exclusive  # bounds a time: alone, not beside another worker's tests (tests/conftest.py)
def test_a_killed_specmesh_up_takes_every_process_with_it_while_streams_are_open(tmp_path: Path) -> None:
    """kill -9 of the launcher: its embedded NATS dies with it, so its services are killed too rather than left
    draining toward nothing (a worker's engine generating for no one, a detokenizer waiting out a minute)."""
    mesh = start_mesh(tmp_path, "--max-num-seqs", "2", "--max-model-len", "256", "--torch-threads", "1",
                      model=E2E_MODEL)
    processes = mesh.children()
    _generating_streams(mesh, "unused")
    sent = time.monotonic()
    mesh.proc.kill()
    mesh.proc.wait()
    left = _left_running(processes, sent)
    assert not left, f"left running {STOP_DEADLINE_S:g} s after kill -9 of specmesh up: {left}"


def _specmesh_nats(store: Path) -> tuple[subprocess.Popen, int]:
    """`specmesh nats` once it is up: listening, the streams declared (what `specmesh up` waits for before it says
    the mesh is up, and so what its stop deadline is promised from; lame-duck mode waits for a declaration under
    way, which on a loaded machine took seconds)."""
    port = free_port()
    cmd = [sys.executable, "-m", "services.cli", "nats", "--port", str(port), "--store-dir", str(store)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_port("127.0.0.1", port, NATS_START_TIMEOUT_S, proc)
    for line in proc.stdout:
        if STREAMS_DECLARED in line:
            break
    [server] = [pid for pid, cmd in descendants(proc.pid).items() if "nats-server" in cmd]
    return proc, server


def _gone_within(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while is_running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not is_running(pid)


@pytest.mark.exclusive  # bounds a time: alone, not beside another worker's tests (tests/conftest.py)
def test_sigterm_to_specmesh_nats_stops_its_server_in_lame_duck_mode(tmp_path: Path) -> None:
    proc, server = _specmesh_nats(tmp_path / "nats")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=STOP_DEADLINE_S) == 0
    assert "lame-duck" in proc.stderr.read()
    assert not is_running(server)


@pytest.mark.exclusive  # bounds a time: alone, not beside another worker's tests (tests/conftest.py)
def test_specmesh_nats_killed_takes_its_server_with_it(tmp_path: Path) -> None:
    proc, server = _specmesh_nats(tmp_path / "nats")
    proc.kill()
    proc.wait()
    assert _gone_within(server, STOP_DEADLINE_S), "nats-server outlived `specmesh nats`"


def _exits_at_once() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])


def test_a_crash_loop_is_restarted_with_growing_delays_until_the_limit(caplog: pytest.LogCaptureFixture) -> None:
    policy = RestartPolicy(max_restarts=3, first_delay_s=0.05, factor=2.0, max_delay_s=0.1)
    crashing = Child(_exits_at_once)
    supervisor = Supervisor([("crasher", crashing)], policy)
    caplog.set_level(logging.WARNING, logger="specmesh.up")
    with pytest.raises(CrashLoopError, match=r"crasher exited with status 3 after 3 restarts in a row"):
        while True:
            supervisor.check()
            time.sleep(0.01)
    assert crashing.restarts == 3
    series = [message for message in caplog.messages if "restarting it in" in message]
    assert len(series) == 3 and all(f"(restart {k} in a row" in m for k, m in zip((1, 2, 3), series))
    assert [policy.delay_s(k) for k in (1, 2, 3)] == [0.05, 0.1, 0.1]  # doubling, capped


def test_a_stop_signal_during_a_childs_start_waits_until_the_child_is_recorded() -> None:
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    SIGNALS.install()
    try:
        with SIGNALS.held():
            os.kill(os.getpid(), signal.SIGTERM)  # delivered here, in the main thread, before the block ends
        with pytest.raises(StopRequested):
            SIGNALS.check()
        SIGNALS.check()  # raised once
        with pytest.raises(StopRequested):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1.0)  # interrupted: outside a start, the signal raises at once
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_a_child_that_stays_up_starts_a_new_crash_series() -> None:
    policy = RestartPolicy(max_restarts=1, first_delay_s=0.01, max_delay_s=0.01, stable_after_s=0.2)
    child = Child(lambda: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.4)"]))
    supervisor = Supervisor([("sleeper", child)], policy)
    deadline = time.monotonic() + 60.0  # a guard against a hang, wide enough for a loaded machine's slow starts
    while child.restarts < 3:  # each run outlives stable_after_s, so no series ever passes max_restarts
        supervisor.check()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    child.proc.kill()
    child.proc.wait()
