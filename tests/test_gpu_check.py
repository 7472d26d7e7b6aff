"""benchmarks/gpu_check.py: its dry run on the CPU writes both reports with every part, every part that can run
here ran, and no target is judged on tiny shapes; a failing part is recorded with its stderr (one past its budget:
test_gpu_check_stop.py); the targets read PASS, FAIL and not measured as they should; and the
full run's budgets fit the issue's 8 minutes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_check
from benchmarks import gpu_check_report as report

pytest.importorskip("transformers")

REPO_ROOT = Path(__file__).resolve().parent.parent
DRY_RUN_TIMEOUT_S = 180  # a hang fails the test; the dry run takes about a minute on 2 cores
ISSUE_LIMIT_S = 8 * 60
SLEEP_S = 60


def test_the_dry_run_writes_both_reports_with_every_part(tmp_path: Path) -> None:
    out = tmp_path / "check"
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--dry-run", "--out", str(out)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=DRY_RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    state = json.loads((out / "gpu_check.json").read_text())
    summary = (out / "summary.txt").read_text()
    assert state["dry_run"] and state["machine"]["device"] == "cpu" and state["machine"]["torch"]
    assert list(state["parts"]) == list(gpu_check.PART_NAMES)
    for part in gpu_check.PARTS:
        entry = state["parts"][part.name]
        assert f"{part.name:<22} {entry['status']}" in summary
        if part.dry_command is None:
            assert entry["status"] == gpu_check.SKIPPED and entry["figures"] is None
            continue
        assert entry["status"] == gpu_check.OK, entry["stderr_tail"]
        assert entry["figures"] and entry["budget_s"] == gpu_check.DRY_BUDGET_S and entry["command"]
        assert (out / part.name / "stderr.txt").exists()
    tests = state["parts"][report.CUDA_TESTS]["figures"]
    # Every CUDA test is collected and, without a GPU, skipped: none failed, none passed without running.
    assert tests["tests"] > 0 and tests["skipped"] == tests["tests"] and tests["passed"] == 0
    assert state["parts"][report.METHODS]["figures"]["greedy_check"]
    assert [t["target"] for t in state["targets"]] == [t.text for t in report.TARGETS]
    assert {t["verdict"] for t in state["targets"]} <= {report.DRY, report.NOT_MEASURED}
    assert report.DRY in {t["verdict"] for t in state["targets"]}
    assert "DRY RUN" in summary and report.PASS not in summary and report.FAIL not in summary


def test_a_failing_part_is_recorded_with_its_stderr(tmp_path: Path) -> None:
    outcome = gpu_check.run_part(["-c", "import sys; sys.exit('the model did not load')"], SLEEP_S, tmp_path,
                                 dict(os.environ))
    assert (outcome.status, outcome.returncode) == (gpu_check.FAILED, 1)
    assert "the model did not load" in outcome.stderr_tail


def _decode(floor_tokens_per_s: float, rows: list[tuple[int, int, float]]) -> dict:
    return {"floor_tokens_per_s_batch1": floor_tokens_per_s,
            "rows": [{"batch": b, "context": c, "ms_per_step": ms, "tokens_per_s": b * 1e3 / ms} for b, c, ms in rows]}


def _run(method: str, batch: int, temperature: float, speedup: float, ms_per_step: float | None = None) -> dict:
    return {"method": method, "batch": batch, "temperature": temperature, "speedup": speedup,
            "ms_per_step": ms_per_step}


def test_targets_read_pass_fail_and_not_measured() -> None:
    figures = {
        # 7B: 6.25 ms (160 tok/s, 0.8 of the floor), 2k 1.12x slower; batch 32 at 2,560 tok/s
        report.DECODE_LARGE: _decode(200.0, [(1, 64, 6.25), (1, 2048, 7.0), (32, 64, 12.5)]),
        # 0.5B: 650 tok/s, 2k 1.2x slower
        report.DECODE_SMALL: _decode(3000.0, [(1, 64, 1e3 / 650), (1, 2048, 1.2e3 / 650)]),
        report.METHODS: {"runs": [
            _run("naive", 1, 0.0, 1.0, ms_per_step=0.9), _run("mtp k=3 steps=3", 1, 0.0, 2.7),
            *[_run("ngram k=3 adaptive", b, t, 1.02) for b in (32, 64) for t in (0.0, 1.0)],
            _run("mtp k=3 steps=3 adaptive", 64, 1.0, 0.97),
        ]},
        report.AGREEMENT: {"rows": [{"method": "ngram k=3", "batch": 32, "sequences": 32, "share": 0.9}]},
    }
    verdicts = [t["verdict"] for t in report.judge_targets(figures, dry_run=False)]
    assert verdicts == [
        report.PASS, report.PASS, report.FAIL,  # 7B: batch 1, its floor share, batch 32
        report.FAIL, report.FAIL, report.PASS,  # 0.5B batch 1; 2k context: 0.5B, 7B
        report.PASS, report.PASS, report.FAIL,  # demo step, MTP, adaptive
        report.NOT_MEASURED, report.MEASURED,  # mesh (not run), bf16 agreement
    ]
    dry = {t["verdict"] for t in report.judge_targets(figures, dry_run=True)}
    assert dry == {report.DRY, report.NOT_MEASURED}


def test_the_full_run_fits_the_issue_s_eight_minutes() -> None:
    assert set(gpu_check.BUDGET_S) == set(gpu_check.PART_NAMES)
    assert sum(p.budget_s for p in gpu_check.PARTS) + gpu_check.STOP_GRACE_S <= gpu_check.TOTAL_BUDGET_S
    assert gpu_check.TOTAL_BUDGET_S <= ISSUE_LIMIT_S
