"""What benchmarks/gpu_check.py reports: each part's key figures read from the files it wrote, the H100 targets
judged on them, and the short text summary.

The figures are read as data: this module imports none of the benchmarks, so one that no longer imports (or
crashes) fails its own part and the report of the others is still written. A target whose figures are missing
is "not measured"; a dry run judges none (its figures come from tiny shapes on a CPU).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from xml.etree import ElementTree

JUNIT_FILE = "junit.xml"
# What reading a part's files raises when it wrote none, or not in the format expected.
FIGURE_ERRORS = (OSError, ValueError, KeyError, TypeError, ElementTree.ParseError)
GRAPHS_SYSTEM = "specmesh naive"  # benchmarks/gpu.py's name for its rows with CUDA graphs
BASELINE = "naive"
MTP_3_STEPS = "mtp k=3 steps=3"
ADAPTIVE_MARK = "adaptive"
MESH_METHOD, MESH_PROMPTS = "naive", "held-out"
GREEDY, SAMPLED = 0.0, 1.0

# Part names, shared with benchmarks/gpu_check.py, which runs them.
CUDA_TESTS, KERNELS = "cuda_tests", "kernels"
DECODE_SMALL, DECODE_LARGE = "decode_qwen2.5-0.5b", "decode_qwen2.5-7b"
PROFILE, METHODS, MESH, AGREEMENT = "profile_qwen2.5-0.5b", "methods", "mesh", "agreement_bf16"

# The H100 targets of issue 18.
LARGE_BATCH1_TOKENS_PER_S = 150
LARGE_BATCH1_FLOOR_SHARE = 0.75
LARGE_BATCH32_TOKENS_PER_S = 2900
SMALL_BATCH1_TOKENS_PER_S = 700
LONG_CONTEXT_SLOWDOWN = 1.15  # ms/step at the longest context over the shortest, batch 1
DEMO_MS_PER_STEP = 1.0
MTP_SPEEDUP = 2.5
ADAPTIVE_FLOOR = 1.0  # adaptive over naive at the same batch and temperature
ADAPTIVE_BATCHES = (32, 64)
MESH_SHARE = 0.9
MESH_STREAMS = (1, 8, 32)
PASS, FAIL, NOT_MEASURED, MEASURED, DRY = "PASS", "FAIL", "not measured", "measured", "dry run"


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def pytest_figures(part_dir: Path) -> dict:
    """Counts from pytest's JUnit XML, and the tests that did not pass."""
    root = ElementTree.parse(part_dir / JUNIT_FILE).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    count = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    not_passed = [f"{case.get('classname')}::{case.get('name')}" for s in suites for case in s.iter("testcase")
                  if case.find("failure") is not None or case.find("error") is not None]
    passed = count["tests"] - count["failures"] - count["errors"] - count["skipped"]
    return {"tests": count["tests"], "passed": passed, "failed": count["failures"], "errors": count["errors"],
            "skipped": count["skipped"], "not_passed": not_passed}


def kernels_figures(part_dir: Path) -> dict:
    rows = _json(part_dir / "kernels.json")["rows"]
    return {"comparisons": len(rows), "differ": [f"{r['kernel']} {r['shape']}" for r in rows if not r["same"]]}


def decode_figures(part_dir: Path) -> dict:
    report = _json(part_dir / "gpu.json")
    (shape,) = report["shapes"]  # a decode part measures one shape
    rows = [r for r in report["rows"] if r["system"] == GRAPHS_SYSTEM]
    return {"shape": shape["shape"], "copy_bandwidth_gb_s": report["copy_bandwidth_gb_s"],
            "floor_ms_per_step": shape["floor"]["ms_per_step"],
            "floor_tokens_per_s_batch1": shape["floor"]["tokens_per_s_batch1"],
            "cuda_graphs": all(r["cuda_graphs"] for r in rows),
            "rows": [{k: r[k] for k in ("batch", "context", "ms_per_step", "tokens_per_s")} for r in rows]}


def profile_figures(part_dir: Path) -> dict:
    keys = ("batch", "ms_per_step_profiled", "kernel_launches", "graph_launches", "copy_calls",
            "device_to_host_copies", "synchronisations")
    return {"rows": [{k: r[k] for k in keys} for r in _json(part_dir / "profile.json")["rows"]]}


def methods_figures(part_dir: Path) -> dict:
    report = _json(part_dir / "methods.json")
    keys = ("method", "batch", "temperature", "tokens_per_s", "speedup", "ms_per_step", "mean_acceptance_length")
    return {"runs": [{k: r[k] for k in keys} for r in report["runs"]], "greedy_check": report["greedy_check"]}


def mesh_figures(part_dir: Path) -> dict:
    report = _json(part_dir / "speculation.json")
    keys = ("prompts", "method", "streams", "engine_tokens_per_s", "mesh_tokens_per_s", "mesh_over_engine")
    return {"rows": [{k: r[k] for k in keys} for r in report["rows"]], "greedy_mismatches": report["greedy_mismatches"]}


def agreement_figures(part_dir: Path) -> dict:
    report = _json(part_dir / "agreement.json")
    return {"dtype": report["dtype"], "rows": [{k: r[k] for k in ("method", "batch", "sequences", "share")}
                                               for r in report["rows"]]}


def _tests_line(figures: dict) -> str:
    line = (f"{figures['tests']} tests: {figures['passed']} passed, {figures['failed']} failed, "
            f"{figures['errors']} errors, {figures['skipped']} skipped")
    return line + "".join(f"\n    not passed: {t}" for t in figures["not_passed"])


def _kernels_line(figures: dict) -> str:
    return f"{figures['comparisons']} kernel/twin comparisons, differ: {', '.join(figures['differ']) or 'none'}"


def _decode_line(figures: dict) -> str:
    head = (f"{figures['shape']}, graphs {'on' if figures['cuda_graphs'] else 'off'}; copy "
            f"{figures['copy_bandwidth_gb_s']:,.0f} GB/s, weight floor {figures['floor_ms_per_step']:.3f} ms "
            f"({figures['floor_tokens_per_s_batch1']:,.0f} tok/s)")
    cells = [f"b{batch}: " + ", ".join(f"{r['ms_per_step']:.2f} ms {r['tokens_per_s']:,.0f} tok/s (ctx {r['context']})"
                                      for r in rows)
             for batch, rows in _grouped(figures["rows"], lambda r: r["batch"]).items()]
    return "\n    ".join([head, *cells])


def _profile_line(figures: dict) -> str:
    return "; ".join(f"b{r['batch']}: {r['kernel_launches']:.0f} kernel + {r['graph_launches']:.0f} graph launches, "
                     f"{r['copy_calls']:.1f} copies ({r['device_to_host_copies']:.1f} to host), "
                     f"{r['synchronisations']:.1f} syncs per step" for r in figures["rows"])


def _methods_line(figures: dict) -> str:
    def cell(run: dict) -> str:
        if run["method"] == BASELINE:
            return f"{run['method']} {run['tokens_per_s']:,.0f} tok/s"
        return f"{run['method']} {_number(run['speedup'], 'x')}"

    cases = _grouped(figures["runs"], lambda r: (r["batch"], r["temperature"]))
    checks = ", ".join(f"{method} {verdict}" for method, verdict in figures["greedy_check"].items())
    return "\n    ".join([f"greedy check: {checks}", *(f"b{batch} T={temperature:g}: " + ", ".join(map(cell, runs))
                                                     for (batch, temperature), runs in cases.items())])


def _mesh_line(figures: dict) -> str:
    cells = [f"{r['method']} {r['prompts']} {r['streams']} streams: engine {r['engine_tokens_per_s']:,.0f}, mesh "
             f"{r['mesh_tokens_per_s']:,.0f} tok/s ({_number(r['mesh_over_engine'])})" for r in figures["rows"]]
    return "; ".join(cells) + f"; greedy mismatches: {len(figures['greedy_mismatches'])}"


def _agreement_line(figures: dict) -> str:
    return f"{figures['dtype']}: " + "; ".join(
        f"{r['method']} b{r['batch']}: {r['share']:.2f} of {r['sequences']} equal naive's" for r in figures["rows"])


PART_LINES: dict[str, Callable[[dict], str]] = {
    CUDA_TESTS: _tests_line, KERNELS: _kernels_line, DECODE_SMALL: _decode_line, DECODE_LARGE: _decode_line,
    PROFILE: _profile_line, METHODS: _methods_line, MESH: _mesh_line, AGREEMENT: _agreement_line,
}


def part_line(name: str, figures: dict) -> str:
    """The key figures of one part in a line (or a few)."""
    return PART_LINES[name](figures)


def _grouped(rows: list[dict], key: Callable[[dict], object]) -> dict[object, list[dict]]:
    """rows by key, keys sorted, each group in the rows' order."""
    groups: dict[object, list[dict]] = {}
    for row in rows:
        groups.setdefault(key(row), []).append(row)
    return dict(sorted(groups.items()))


def _number(value: float | None, unit: str = "", digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}{unit}"


@dataclass(frozen=True)
class Judgement:
    measured: str
    passed: bool | None  # None: a figure reported, not judged


@dataclass(frozen=True)
class Target:
    text: str
    judge: Callable[[dict[str, dict]], Judgement | None]  # the parts' figures by name -> None: not measured


def _decode_row(figures: dict[str, dict], part: str, batch: int, longest: bool = False) -> dict | None:
    rows = [r for r in figures.get(part, {}).get("rows", []) if r["batch"] == batch]
    return (max if longest else min)(rows, key=lambda r: r["context"]) if rows else None


def _at_least(part: str, batch: int, floor: float) -> Callable[[dict[str, dict]], Judgement | None]:
    def judge(figures: dict[str, dict]) -> Judgement | None:
        row = _decode_row(figures, part, batch)
        if row is None:
            return None
        return Judgement(f"{row['tokens_per_s']:,.0f} tok/s (context {row['context']})", row["tokens_per_s"] >= floor)
    return judge


def _floor_share(figures: dict[str, dict]) -> Judgement | None:
    row = _decode_row(figures, DECODE_LARGE, 1)
    if row is None:
        return None
    share = row["tokens_per_s"] / figures[DECODE_LARGE]["floor_tokens_per_s_batch1"]
    return Judgement(f"{share:.2f} of {figures[DECODE_LARGE]['floor_tokens_per_s_batch1']:,.0f} tok/s",
                     share >= LARGE_BATCH1_FLOOR_SHARE)


def _long_context(part: str) -> Callable[[dict[str, dict]], Judgement | None]:
    def judge(figures: dict[str, dict]) -> Judgement | None:
        short, long = _decode_row(figures, part, 1), _decode_row(figures, part, 1, longest=True)
        if short is None or short["context"] == long["context"]:
            return None
        ratio = long["ms_per_step"] / short["ms_per_step"]
        return Judgement(f"{ratio:.2f}x ({long['ms_per_step']:.2f} / {short['ms_per_step']:.2f} ms, contexts "
                         f"{long['context']} / {short['context']})", ratio <= LONG_CONTEXT_SLOWDOWN)
    return judge


def _run(figures: dict[str, dict], method: str, batch: int, temperature: float) -> dict | None:
    runs = figures.get(METHODS, {}).get("runs", [])
    return next((r for r in runs if (r["method"], r["batch"], r["temperature"]) == (method, batch, temperature)),
                None)


def _demo_step(figures: dict[str, dict]) -> Judgement | None:
    run = _run(figures, BASELINE, 1, GREEDY)
    if run is None or run["ms_per_step"] is None:
        return None
    return Judgement(f"{run['ms_per_step']:.3f} ms (naive, T=0, prefill steps included)",
                     run["ms_per_step"] <= DEMO_MS_PER_STEP)


def _mtp_speedup(figures: dict[str, dict]) -> Judgement | None:
    run = _run(figures, MTP_3_STEPS, 1, GREEDY)
    if run is None or run["speedup"] is None:
        return None
    return Judgement(f"{run['speedup']:.2f}x (T=0)", run["speedup"] >= MTP_SPEEDUP)


def _adaptive(figures: dict[str, dict]) -> Judgement | None:
    runs = [r for r in figures.get(METHODS, {}).get("runs", [])
            if ADAPTIVE_MARK in r["method"] and r["batch"] in ADAPTIVE_BATCHES and r["speedup"] is not None]
    cases = {(b, t) for b in ADAPTIVE_BATCHES for t in (GREEDY, SAMPLED)}
    if {(r["batch"], r["temperature"]) for r in runs} != cases:
        return None
    worst = min(runs, key=lambda r: r["speedup"])
    return Judgement(f"lowest {worst['speedup']:.2f}x ({worst['method']}, b{worst['batch']}, "
                     f"T={worst['temperature']:g}) of {len(runs)} runs", worst["speedup"] >= ADAPTIVE_FLOOR)


def _mesh(figures: dict[str, dict]) -> Judgement | None:
    rows = {r["streams"]: r["mesh_over_engine"] for r in figures.get(MESH, {}).get("rows", [])
            if (r["method"], r["prompts"]) == (MESH_METHOD, MESH_PROMPTS) and r["mesh_over_engine"] is not None}
    if not set(MESH_STREAMS) <= rows.keys():
        return None
    return Judgement(", ".join(f"{rows[s]:.2f} ({s})" for s in MESH_STREAMS),
                     min(rows[s] for s in MESH_STREAMS) >= MESH_SHARE)


def _agreement(figures: dict[str, dict]) -> Judgement | None:
    rows = figures.get(AGREEMENT, {}).get("rows", [])
    if not rows:
        return None
    return Judgement(", ".join(f"{r['method']} b{r['batch']} {r['share']:.2f}" for r in rows), None)


TARGETS = (
    Target(f"Qwen2.5-7B batch 1 >= {LARGE_BATCH1_TOKENS_PER_S} tok/s",
           _at_least(DECODE_LARGE, 1, LARGE_BATCH1_TOKENS_PER_S)),
    Target(f"Qwen2.5-7B batch 1 >= {LARGE_BATCH1_FLOOR_SHARE} of the weight-read floor", _floor_share),
    Target(f"Qwen2.5-7B batch 32 >= {LARGE_BATCH32_TOKENS_PER_S:,} tok/s",
           _at_least(DECODE_LARGE, 32, LARGE_BATCH32_TOKENS_PER_S)),
    Target(f"Qwen2.5-0.5B batch 1 >= {SMALL_BATCH1_TOKENS_PER_S} tok/s",
           _at_least(DECODE_SMALL, 1, SMALL_BATCH1_TOKENS_PER_S)),
    Target(f"Qwen2.5-0.5B batch 1: 2k context <= {LONG_CONTEXT_SLOWDOWN:g}x the step at 64",
           _long_context(DECODE_SMALL)),
    Target(f"Qwen2.5-7B batch 1: 2k context <= {LONG_CONTEXT_SLOWDOWN:g}x the step at 64",
           _long_context(DECODE_LARGE)),
    Target(f"demo model <= {DEMO_MS_PER_STEP:g} ms per decode step at batch 1", _demo_step),
    Target(f"MTP, 3 model steps, >= {MTP_SPEEDUP:g}x naive at batch 1", _mtp_speedup),
    Target("adaptive never below naive at batch 32 and 64, T=0 and T=1", _adaptive),
    Target(f"mesh >= {MESH_SHARE:g} of engine at {', '.join(map(str, MESH_STREAMS))} streams", _mesh),
    Target("bf16: share of speculative greedy outputs equal to naive's", _agreement),
)


def judge_targets(figures: dict[str, dict], dry_run: bool) -> list[dict]:
    """Every target: what was measured and PASS / FAIL / measured (a figure only) / not measured / dry run."""
    rows = []
    for target in TARGETS:
        judgement = target.judge(figures)
        if judgement is None:
            verdict, measured = NOT_MEASURED, "–"
        else:
            measured = judgement.measured
            verdict = DRY if dry_run else MEASURED if judgement.passed is None else PASS if judgement.passed else FAIL
        rows.append({"target": target.text, "measured": measured, "verdict": verdict})
    return rows


def summary_text(report: dict) -> str:
    """A short summary of gpu_check.json: the machine, one entry per part, then the targets."""
    machine = report["machine"]
    lines = [f"specmesh GPU check on {machine['device_name']} (torch {machine['torch']}, triton {machine['triton']}, "
             f"transformers {machine['transformers']}): {report['seconds']:.0f} s of {report['total_budget_s']:.0f} s"]
    if machine["missing_modules"]:
        lines.append(f"MISSING MODULES (the parts that import them fail): {', '.join(machine['missing_modules'])}")
    if report["dry_run"]:
        lines.append("DRY RUN: tiny shapes on the CPU; the figures show that the plumbing works and judge nothing")
    lines += ["", "parts:"]
    for name, part in report["parts"].items():
        timing = f"{part['seconds']:.0f} s / {part['budget_s']:.0f} s" if part["seconds"] is not None else ""
        status = part["status"] + (f" (rc {part['returncode']})" if part["returncode"] else "")
        lines.append(f"  {name:<22} {status:<14} {timing:<13} {part['detail']}")
    width = max(len(t["target"]) for t in report["targets"])
    lines += ["", "targets (one H100):"]
    lines += [f"  {t['verdict']:<12} {t['target']:<{width}}  {t['measured']}" for t in report["targets"]]
    return "\n".join(lines) + "\n"
