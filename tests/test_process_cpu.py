"""The load benchmark's CPU meter (benchmarks/process_cpu.py) on a real process tree: a child's busy time is found
under its parent and counted once, and every mesh process is named by its role from its command line."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from benchmarks.process_cpu import OTHER, OUTSIDE, CpuMeter, role_of
from services.process_tree import cpu_seconds, descendants

BUSY_S = 0.6
CHILD = f"import time\nstart = time.time()\nwhile time.time() - start < {BUSY_S}: pass\ntime.sleep(30)"
PARENT = f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', {CHILD!r}]).wait()"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.exclusive  # bounds a time: alone, not beside another worker's tests (tests/conftest.py)
def test_a_busy_child_counts_under_its_parent_once() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT])
    try:
        meter = CpuMeter(parent.pid)
        meter.start()
        deadline = time.monotonic() + 10
        while not descendants(parent.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(BUSY_S + 0.4)
        [child] = descendants(parent.pid)
        seconds = meter.stop()
        assert 0.5 * BUSY_S < seconds[OTHER] < 2 * BUSY_S + 0.5  # the child's loop, plus two interpreters' start
        assert seconds[OUTSIDE] >= 0
        assert cpu_seconds(child) >= 0.5 * BUSY_S
    finally:
        for pid in descendants(parent.pid):
            subprocess.run(["kill", str(pid)], check=False)
        parent.wait(timeout=10)
    assert cpu_seconds(parent.pid) is None  # gone: not counted


def test_mesh_processes_are_named_by_role() -> None:
    venv = "/x/.venv/bin/python3"
    assert role_of(f"{venv} -m services.cli gateway --model m") == "gateway"
    assert role_of(f"{venv} -m services.cli detokenizer --model m") == "detokenizer"
    assert role_of(f"{venv} -m services.cli worker --model m") == "worker loop"
    assert role_of(f"{venv} -B -c from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5)") == "engine"
    assert role_of("/x/.venv/bin/nats-server --jetstream --port 4222") == "nats"
    assert role_of(f"{venv} /x/.venv/bin/specmesh up --port 8000") == "launcher"
    assert role_of(f"{venv} -m services.cli up --model m") == "launcher"
    assert role_of(f"{venv} -c from multiprocessing.resource_tracker import main;main(7)") == OTHER
