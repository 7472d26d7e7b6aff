"""Test checkpoints built once per test run.

Test modules import the shared fixtures by name, and pytest gives every module that holds a fixture its own
instance of it, session scope or not: without this memo each module would train its own tiny model and fit its own
MTP module and EAGLE-3 head (~12 s a module). The suite's workers (tests/conftest.py) share one build too: the first
to need a checkpoint builds it under a lock in the run's shared directory and leaves its result (paths into its own
temporary directory, which lives as long as the run) for the others. The checkpoints are read, never written, by the
tests.
"""

from __future__ import annotations

import fcntl
import os
import pickle
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
SHARED_DIR_ENV = "SPECMESH_TESTS_SHARED_DIR"
_BUILT: dict[str, object] = {}


def once(key: str, build: Callable[[], T]) -> T:
    """build()'s result, built at the first call with this key in this run (in this process, where no shared
    directory is set)."""
    if key not in _BUILT:
        _BUILT[key] = _built_by_any_worker(key, build)
    return _BUILT[key]  # type: ignore[return-value]


@contextmanager
def locked(path: Path, mode: int) -> Iterator[None]:
    """flock(path, mode) held for the block, for the run's workers (tests/conftest.py too)."""
    with open(path, "a") as f:
        fcntl.flock(f, mode)
        try:
            yield
        finally:  # not left to the file's closing: a process forked meanwhile would hold the lock on
            fcntl.flock(f, fcntl.LOCK_UN)


def _built_by_any_worker(key: str, build: Callable[[], T]) -> T:
    shared = os.environ.get(SHARED_DIR_ENV)
    if shared is None:
        return build()
    result = Path(shared) / f"{key}.pickle"
    with locked(Path(shared) / f"{key}.lock", fcntl.LOCK_EX):
        if result.exists():
            return pickle.loads(result.read_bytes())
        value = build()
        result.write_bytes(pickle.dumps(value))
        return value
