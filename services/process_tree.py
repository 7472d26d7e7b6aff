"""The processes below a process, read from Linux's /proc: how tests and operators check that a command left
nothing running behind it."""

from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")
ZOMBIE = "Z"  # /proc/<pid>/stat state of a process that has exited and waits only to be reaped


# /proc/<pid>/stat fields after the command name: state, ppid, ..., utime and stime (clock ticks)
STATE, PARENT, USER_TICKS, SYSTEM_TICKS = 0, 1, 11, 12
TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name, or None once the process is gone."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # "pid (comm) state ppid ...": comm may itself hold spaces and parentheses, so split after its last ")".
    return text.rpartition(")")[2].split()


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process, or None once it is gone."""
    fields = _stat_fields(pid)
    return None if fields is None else (fields[STATE], int(fields[PARENT]))


def cpu_seconds(pid: int) -> float | None:
    """User plus system CPU seconds of a process so far (not its children's); None once it is gone."""
    fields = _stat_fields(pid)
    return None if fields is None else (int(fields[USER_TICKS]) + int(fields[SYSTEM_TICKS])) / TICKS_PER_S


def is_running(pid: int) -> bool:
    """Whether the process exists and has not exited (a zombie has)."""
    stat = _stat(pid)
    return stat is not None and stat[0] != ZOMBIE


def command_line(pid: int) -> str:
    try:
        return (PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def descendants(pid: int) -> dict[int, str]:
    """Every running process below `pid` (its children, theirs, ...) with its command line."""
    parents: dict[int, int] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None and stat[0] != ZOMBIE:
                parents[int(entry.name)] = stat[1]
    found: dict[int, str] = {}
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for child, its_parent in parents.items():
            if its_parent == parent and child not in found:
                found[child] = command_line(child)
                frontier.append(child)
    return found
