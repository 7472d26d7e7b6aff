"""Child processes that `specmesh up` keeps running: a child that exits is started again after an exponential
backoff, and only a child that keeps crashing (more restarts in a row than the policy allows) ends the mesh.
Stopping is bounded: SIGTERM, a grace period, then SIGKILL to the child's whole process group.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

log = logging.getLogger("specmesh.up")

PR_SET_PDEATHSIG = 1  # Linux prctl option: signal the child when its parent dies
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def die_with_parent(signum: int = signal.SIGTERM) -> None:
    """preexec_fn of every child: SIGTERM (or `signum`) when the launcher dies, even by SIGKILL, so that no child
    outlives it."""
    try:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signum)
    except (OSError, AttributeError):
        pass  # not Linux: the launcher's own shutdown still stops every child


class StopRequested(Exception):
    """SIGINT or SIGTERM reached the launcher."""


class StopSignals:
    """SIGINT and SIGTERM as StopRequested, raised wherever the launcher is waiting, except while a child is
    being started: raised there, it could leave a started process unrecorded. A signal that arrives then is kept
    for check(), which the launcher's wait loops call once the new child is in their list."""

    def __init__(self) -> None:
        self._holding = False
        self._pending = False

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)

    def ignore(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)

    def _on_signal(self, signum: int, frame: object) -> None:
        if self._holding:
            self._pending = True
        else:
            raise StopRequested

    @contextmanager
    def held(self) -> Iterator[None]:
        self._holding = True
        try:
            yield
        finally:
            self._holding = False

    def check(self) -> None:
        """Raises StopRequested for a signal that arrived while a child was being started."""
        if self._pending:
            self._pending = False
            raise StopRequested


SIGNALS = StopSignals()  # signal dispositions belong to the process, so there is one


class Child:
    """A child process and how to start it again; restart() replaces the process with a new one."""

    def __init__(self, start: Callable[[], subprocess.Popen]) -> None:
        self._start = start
        self.restarts = 0
        self.crashes_in_a_row = 0
        self.restart_at: float | None = None  # monotonic time of the pending restart, if the child is down
        self.proc = self._launch()

    def _launch(self) -> subprocess.Popen:
        with SIGNALS.held():
            proc = self._start()
        self.started_at = time.monotonic()
        return proc

    def restart(self) -> None:
        self.proc = self._launch()
        self.restarts += 1
        self.restart_at = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()


@dataclass(frozen=True)
class RestartPolicy:
    """Backoff before restart k of a crash series: first_delay_s * factor**(k-1), at most max_delay_s. A child that
    has run stable_after_s starts a new series; a series longer than max_restarts ends the mesh."""

    max_restarts: int = 5
    first_delay_s: float = 0.5
    factor: float = 2.0
    max_delay_s: float = 8.0
    stable_after_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if not (0.0 < self.first_delay_s <= self.max_delay_s) or self.factor < 1.0 or self.stable_after_s <= 0.0:
            raise ValueError(f"inconsistent restart policy {self}")

    def delay_s(self, crashes_in_a_row: int) -> float:
        return min(self.max_delay_s, self.first_delay_s * self.factor ** (crashes_in_a_row - 1))


class CrashLoopError(RuntimeError):
    """A child kept crashing: the mesh gives up instead of restarting it forever."""


class Supervisor:
    """Restarts the children that exit. check() is called from the launcher's wait loop; it never blocks longer
    than a child's start takes."""

    def __init__(self, children: list[tuple[str, Child]], policy: RestartPolicy) -> None:
        self.children = children
        self.policy = policy

    def check(self) -> None:
        SIGNALS.check()
        now = time.monotonic()
        for name, child in self.children:
            status = child.poll()
            if status is None:
                if now - child.started_at >= self.policy.stable_after_s:
                    child.crashes_in_a_row = 0
            elif child.restart_at is None:
                self._schedule(name, child, status, now)
            elif now >= child.restart_at:
                self._restart(name, child)

    def _schedule(self, name: str, child: Child, status: int, now: float) -> None:
        child.crashes_in_a_row += 1
        if child.crashes_in_a_row > self.policy.max_restarts:
            raise CrashLoopError(
                f"{name} exited with status {status} after {child.crashes_in_a_row - 1} restarts in a row "
                f"(limit --max-restarts {self.policy.max_restarts}); stopping the mesh"
            )
        delay = self.policy.delay_s(child.crashes_in_a_row)
        child.restart_at = now + delay
        log.warning(
            "%s (pid %d) exited with status %d; restarting it in %.1fs (restart %d in a row, %d in all)",
            name, child.pid, status, delay, child.crashes_in_a_row, child.restarts + 1,
        )

    def _restart(self, name: str, child: Child) -> None:
        try:
            child.restart()
        except (OSError, RuntimeError, TimeoutError) as exc:
            # A start that fails counts as a crash of the new process: the next check schedules it with more delay.
            log.warning("%s could not be restarted: %s", name, exc)
            child.restarts += 1
            child.restart_at = None
            return
        log.warning("%s restarted as pid %d (restart %d in all)", name, child.pid, child.restarts)


def stop_children(children: list[tuple[str, Child]], grace_s: float) -> None:
    """SIGTERM to every child at once, then SIGKILL to the process group of each one still running after grace_s
    (each child leads its own session, so its own children go with it)."""
    for _, child in children:
        if child.poll() is None:
            child.proc.terminate()
    deadline = time.monotonic() + grace_s
    for name, child in children:
        try:
            child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop within %.1fs of SIGTERM; killing it", name, grace_s)
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                child.proc.kill()  # not a group leader after all, or gone already (then this does nothing)
            child.proc.wait()
