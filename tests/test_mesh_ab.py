"""benchmarks/mesh_ab.py: a method's passes against naive's on two real meshes, taking turns."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.heldout import text_prompts
from benchmarks.speculation import bracketed_ratios
from shared.config import DEFAULT_MODEL_DIR
from shared.tokenizer import Tokenizer

REPO_README = Path(__file__).resolve().parent.parent / "README.md"  # prose the demo model never trained on


def test_a_method_pass_is_set_against_the_naive_passes_on_either_side() -> None:
    assert bracketed_ratios([100.0, 300.0, 200.0], [300.0, 500.0]) == [1.5, 2.0]


def test_a_text_file_gives_evenly_spaced_windows_of_its_tokens() -> None:
    tokenizer = Tokenizer(DEFAULT_MODEL_DIR)
    ids = tokenizer.encode(REPO_README.read_text())
    prompts = text_prompts(tokenizer, REPO_README, 4, 16)
    span = len(ids) - 16
    assert prompts == [ids[i * span // 4 : i * span // 4 + 16] for i in range(4)]
    assert prompts == text_prompts(tokenizer, REPO_README, 4, 16) and len({tuple(p) for p in prompts}) == 4


def test_the_benchmark_alternates_two_meshes_and_checks_the_greedy_text(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.mesh_ab", "--methods", "draft_model", "--requests", "2", "--rounds", "2",
         "--max-tokens", "3", "--prompt-tokens", "8", "--prompts", str(REPO_README), "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=280,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "greedy check: OK" in done.stdout
    report = json.loads((tmp_path / "mesh_ab.json").read_text())
    (row,) = report["rows"]
    assert row["method"] == "draft_model k=3" and row["requests"] == 2
    assert len(row["method_passes"]) == 2 and len(row["baseline_passes"]) == 3
    assert row["ratio_min"] <= row["ratio"] <= row["ratio_max"]
    assert (tmp_path / "table.md").read_text().startswith("| method |")
