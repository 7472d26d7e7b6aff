"""tests/conftest.py and tests/sessioncache.py: what the suite's workers share. A checkpoint is built by one worker
for all; an exclusive test holds the run's lock alone, and a test waiting for it stops others from coming in."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import conftest
from tests.sessioncache import SHARED_DIR_ENV

REPO_ROOT = Path(__file__).resolve().parent.parent
WORKERS = 3
HOLD = "held"
TIMEOUT_S = 60

BUILD_ONCE = """
import sys
from pathlib import Path
from tests.sessioncache import once

def build():
    with open(sys.argv[1], "a") as log:
        log.write("built\\n")
    return Path(sys.argv[1]).parent / "checkpoint"

print(once("a-checkpoint", build))
"""

HOLD_ROOM = """
import sys
from tests import conftest

with conftest._room(exclusive=sys.argv[1] == "exclusive"):
    print("held", flush=True)
    sys.stdin.readline()
"""


def _python(script: str, *args: str, shared: Path, **options) -> subprocess.Popen:
    env = {**os.environ, SHARED_DIR_ENV: str(shared)}
    return subprocess.Popen([sys.executable, "-c", script, *args], cwd=REPO_ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, **options)


def test_workers_build_a_checkpoint_once_and_all_get_its_result(tmp_path: Path) -> None:
    log = tmp_path / "builds.log"
    workers = [_python(BUILD_ONCE, str(log), shared=tmp_path) for _ in range(WORKERS)]
    results = {worker.communicate(timeout=TIMEOUT_S)[0].strip() for worker in workers}
    assert [w.returncode for w in workers] == [0] * WORKERS
    assert results == {str(tmp_path / "checkpoint")}
    assert log.read_text() == "built\n"


def _holding(mode: str, shared: Path) -> subprocess.Popen:
    holder = _python(HOLD_ROOM, mode, shared=shared, stdin=subprocess.PIPE)
    assert holder.stdout.readline().strip() == HOLD
    return holder


def _release(holder: subprocess.Popen) -> None:
    holder.communicate("\n", timeout=TIMEOUT_S)
    assert holder.returncode == 0


def _can_take(shared: Path, name: str, mode: int) -> bool:
    with open(shared / name, "a") as f:
        try:
            fcntl.flock(f, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(f, fcntl.LOCK_UN)
        return True


@pytest.mark.parametrize("mode", ["exclusive", "shared"])
def test_an_exclusive_test_runs_alone_and_shared_ones_together(tmp_path: Path, mode: str) -> None:
    holder = _holding(mode, tmp_path)
    try:
        # another shared test comes in beside a shared one, never beside an exclusive one
        assert _can_take(tmp_path, conftest.ROOM_FILE, fcntl.LOCK_SH) == (mode == "shared")
        assert not _can_take(tmp_path, conftest.ROOM_FILE, fcntl.LOCK_EX)
    finally:
        _release(holder)
    assert _can_take(tmp_path, conftest.ROOM_FILE, fcntl.LOCK_EX)


def test_a_waiting_exclusive_test_lets_no_new_test_in(tmp_path: Path) -> None:
    running = _holding("shared", tmp_path)
    waiting = _python(HOLD_ROOM, "exclusive", shared=tmp_path, stdin=subprocess.PIPE)
    try:
        while _can_take(tmp_path, conftest.TURNSTILE_FILE, fcntl.LOCK_EX):  # until the exclusive one waits at it
            assert waiting.poll() is None
        assert not _can_take(tmp_path, conftest.TURNSTILE_FILE, fcntl.LOCK_EX)
    finally:
        _release(running)
    assert waiting.stdout.readline().strip() == HOLD
    assert not _can_take(tmp_path, conftest.ROOM_FILE, fcntl.LOCK_SH)
    _release(waiting)
