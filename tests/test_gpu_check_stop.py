"""benchmarks/gpu_check.py: a part past its budget is stopped with its whole process group, within the budget and
the grace. Its own module, because it runs alone (the `exclusive` mark): tests/conftest.py hands such modules out
first, where test_gpu_check's minute-long dry run would hold the other worker's exclusive tests back."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from benchmarks import gpu_check

SHORT_BUDGET_S = 1.0
SLACK_S = 3.0
SLEEP_S = 60


def _gone(pid: int) -> bool:
    """No such process, or only its zombie left for its new parent to reap."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.exclusive  # bounds a time: alone, not beside another worker's tests (tests/conftest.py)
def test_a_part_past_its_budget_is_stopped_with_its_process_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    script = (f"import pathlib, subprocess, time; child = subprocess.Popen(['sleep', '{SLEEP_S}']); "
              f"pathlib.Path({str(pid_file)!r}).write_text(str(child.pid)); time.sleep({SLEEP_S})")
    outcome = gpu_check.run_part(["-c", script], SHORT_BUDGET_S, tmp_path / "part", dict(os.environ))
    assert outcome.status == gpu_check.TIMED_OUT and outcome.returncode is None
    assert outcome.seconds < SHORT_BUDGET_S + gpu_check.STOP_GRACE_S
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + SLACK_S
    while not _gone(grandchild) and time.monotonic() < deadline:
        time.sleep(gpu_check.POLL_S)
    assert _gone(grandchild)
