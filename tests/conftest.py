"""The suite on several pytest-xdist workers (pyproject's addopts): what the workers share.

- A directory for the whole run (SHARED_DIR_ENV), made by the controlling process before the workers start, so that
  tests/sessioncache.py builds each test checkpoint once for all workers rather than once per worker.
- One torch intra-op thread per worker: two workers on two cores, each with two threads, wait on each other.
- Bytecode caches written and read, even where the environment turns them off (PYTHONDONTWRITEBYTECODE, as on
  this project's machines): the suite starts a few hundred Python processes (meshes, services, engines), and each
  would otherwise compile every module it imports anew (~0.2-0.5 CPU-seconds a process).
- The `exclusive` mark: a test that bounds how long something takes (a stop within five seconds, a stall within a
  few) runs its body alone, while the other workers wait between their tests' phases. Every other phase (setup,
  teardown, an unmarked test's body) holds the run's lock shared.
  A waiting exclusive test first takes a turnstile that every test passes on its way in, so that the other workers
  cannot keep the lock shared forever (writer preference).
- One demo mesh per worker (demo_mesh), for the API modules that need no special server options
  (tests/demomeshfixture.py): a start costs ~5 CPU-seconds.
- The order modules are handed out in (pyproject keeps collection order): those with an exclusive test first, so that
  they wait on each other's short tests at the start of the run, not on a minute-long test in the middle of it; then
  those that start whole meshes; the many small modules last, which even out the two workers' ends.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from services.mesh_process import Mesh
from tests.demomeshfixture import MESH_OPTIONS, running_mesh
from tests.sessioncache import SHARED_DIR_ENV, locked

os.environ.pop("PYTHONDONTWRITEBYTECODE", None)  # before the workers and every process they start inherit it
sys.dont_write_bytecode = False  # this process's own imports, and pytest's rewritten test modules

EXCLUSIVE = "exclusive"
E2E = "e2e"
TURNSTILE_FILE = "turnstile.lock"
ROOM_FILE = "room.lock"


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the controlling process (or a run without workers)
        os.environ[SHARED_DIR_ENV] = tempfile.mkdtemp(prefix="specmesh-tests-")
    else:
        import torch  # here: a process that only takes the locks below need not load it

        torch.set_num_threads(1)


def pytest_unconfigure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):
        shutil.rmtree(os.environ.pop(SHARED_DIR_ENV), ignore_errors=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    exclusive = {item.path for item in items if item.get_closest_marker(EXCLUSIVE) is not None}
    meshes = {item.path for item in items if item.get_closest_marker(E2E) is not None}
    # stable: each module's own order kept
    items.sort(key=lambda item: (item.path not in exclusive, item.path not in meshes))


@contextmanager
def _room(exclusive: bool) -> Iterator[None]:
    shared = Path(os.environ[SHARED_DIR_ENV])
    if exclusive:
        with locked(shared / TURNSTILE_FILE, fcntl.LOCK_EX), locked(shared / ROOM_FILE, fcntl.LOCK_EX):
            yield
        return
    with ExitStack() as held:
        with locked(shared / TURNSTILE_FILE, fcntl.LOCK_EX):  # passed on the way in, not held
            held.enter_context(locked(shared / ROOM_FILE, fcntl.LOCK_SH))
        yield


# Each phase takes the lock on its own: an exclusive test's bound lies in its body, so the meshes its fixtures start
# and stop (seconds each) run beside the other workers' tests.
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    with _room(exclusive=False):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with _room(item.get_closest_marker(EXCLUSIVE) is not None):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    with _room(exclusive=False):
        yield


@pytest.fixture(scope="session")
def demo_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    yield from running_mesh(tmp_path_factory, *MESH_OPTIONS)
