"""One prepared check of a GPU machine (issue 18): the CUDA tests and the speed figures, in at most 8 minutes on
one H100, each part under its own time budget so that a part that fails or hangs cannot eat the others' time.

    python -m benchmarks.gpu_check --out DIR [--dry-run] [--only PART ...]

Parts, each a subprocess (`python -m ...`) killed with its process group when its budget runs out:

- cuda_tests: tests/test_cuda.py and tests/test_cuda_graph.py (every model-op kernel against its twin on CUDA,
  graph capture and replay, the engine's float32 greedy tokens equal transformers' for every method, the dummy
  8B load);
- kernels: benchmarks/kernels.py, the sampling, verify, logprobs and ngram kernels against their twins;
- decode_qwen2.5-0.5b, decode_qwen2.5-7b: benchmarks/gpu.py, plain decoding with CUDA graphs at batch 1, 32
  (and 64 for the 0.5B), contexts 64 and 2,048, beside the weight-read floor at this run's copy bandwidth;
- profile_qwen2.5-0.5b: benchmarks/step_profile.py, the 0.5B step's launches, host copies and syncs;
- methods: benchmarks/methods.py, the demo model's naive, ngram, MTP (3 model steps) and adaptive methods at
  batch 1, 32 and 64, T=0 and T=1;
- mesh: benchmarks/speculation.py, naive through the mesh against the engine at 1, 8 and 32 streams;
- agreement_bf16: benchmarks/agreement.py, in bfloat16 the share of speculative greedy outputs equal to naive's
  at batch 1 and 32.

Writes DIR/gpu_check.json (the machine, and per part: status, seconds, budget, command, the tail of its stderr,
its key figures), DIR/summary.txt (a line per part, then the H100 targets: PASS, FAIL or not measured;
benchmarks/gpu_check_report.py), and each part's own files, stdout.txt and stderr.txt under DIR/<part>/. Both
reports are rewritten after every part, so they exist whatever happens to the later parts. Exit status 1 when a
part did not end "ok".

--dry-run runs the same parts on the CPU with tiny shapes (the demo model), the methods part at batch 1 for the
baseline and adaptive MTP only, in about a minute; parts that need CUDA are recorded "skipped" (kernels) or run with
their CUDA tests skipped by pytest, and the 7B decode part, whose CPU form would repeat the 0.5B's, is skipped. The
suite runs it (tests/test_gpu_check.py), so the check cannot rot between GPU leases.

On a lent GPU machine (its image has torch, triton and transformers, not nats-py, orjson, pydantic or openai):
first, here, `bash ../shared/gpu/wheels.sh` (writes the missing wheels to .whl/), then on the device:

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \\
        && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH \\
        && python -m benchmarks.gpu_check --out $OUT/gpu-check
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata, util
from pathlib import Path

from benchmarks import gpu_check_report as report
from shared.config import DEFAULT_MODEL_DIR

REPO_ROOT = Path(__file__).resolve().parent.parent
TOTAL_BUDGET_S = 470.0  # the 8 minutes, less this process's own start and the reports
# Each part's budget on one H100, in seconds: its process's start, loads, first-use compilation (Triton, graph
# capture) and its runs, with room to spare. Their sum, 450, leaves TOTAL_BUDGET_S room for stopping parts.
BUDGET_S = {report.CUDA_TESTS: 90.0, report.KERNELS: 30.0, report.DECODE_SMALL: 50.0, report.DECODE_LARGE: 75.0,
            report.PROFILE: 30.0, report.METHODS: 70.0, report.MESH: 65.0, report.AGREEMENT: 40.0}
STOP_GRACE_S = 5.0  # SIGTERM to SIGKILL: `specmesh up` stops its children within five seconds
DRY_BUDGET_S = 90.0  # a dry part on a small, shared CPU machine (methods took 70 s of 60 beside other work)
DRY_TOTAL_BUDGET_S = 240.0
STDERR_TAIL_CHARS = 2000
# What the parts import beyond the standard library; a GPU image that lacks one fails those parts at import, so the
# report names the missing ones first (../shared/gpu/wheels.sh fetches the wheels an image lacks).
NEEDED_MODULES = ("torch", "triton", "transformers", "pytest", "matplotlib", "numpy", "aiohttp", "nats", "orjson",
                  "pydantic", "tokenizers", "safetensors")
POLL_S = 0.05
OK, FAILED, TIMED_OUT, SKIPPED, NOT_RUN, RUNNING = "ok", "failed", "timed out", "skipped", "not run", "running"
DEMO = str(DEFAULT_MODEL_DIR)
# The CUDA tests alone: on a CPU every one of them is skipped, so a dry run costs pytest's start only.
CUDA_ONLY_TESTS = ("tests/test_cuda.py",
                   "tests/test_cuda_graph.py::test_captured_graphs_replay_transformers_greedy_tokens")
METHOD_NAMES = ("naive", "ngram k=3", "mtp k=3 steps=3", "ngram k=3 adaptive", "mtp k=3 steps=3 adaptive")
DRY_METHOD_NAMES = (METHOD_NAMES[0], METHOD_NAMES[-1])  # the baseline and the most plumbing: drafts, adaptive
DRY_DECODE = ("--shape-dir", DEMO, "--device", "cpu", "--dtype", "float32", "--batches", "1", "2", "--contexts", "8",
              "16", "--warmup-steps", "1", "--steps", "2", "--repeats", "1", "--copy-mib", "4")
Command = Callable[[Path], list[str]]  # the part's output directory -> arguments of `python`


@dataclass(frozen=True)
class Part:
    name: str
    command: Command
    dry_command: Command | None  # on the CPU, tiny shapes; None: skipped in a dry run, for dry_skip's reason
    figures: Callable[[Path], dict]  # reads the part's output directory
    dry_skip: str = "needs CUDA: it has no CPU form"

    @property
    def budget_s(self) -> float:
        return BUDGET_S[self.name]


def _pytest(tests: tuple[str, ...]) -> Command:
    # In one process, without pyproject's worker options: the GPU machine's image has no pytest-xdist, and the
    # CUDA tests share one device. They use no hypothesis, whose plugin costs pytest's start ~2 s.
    return lambda out: ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:langsmith_plugin", "-p", "no:locust",
                        "-p", "no:hypothesispytest", "-o", "addopts=", *tests,
                        "--junitxml", str(out / report.JUNIT_FILE)]


def _decode(*args: str) -> Command:
    return lambda out: ["-m", "benchmarks.gpu", *args, "--skip", "transformers", "eager", "--out", str(out)]


def _module(name: str, *args: str) -> Command:
    return lambda out: ["-m", name, *args, "--out", str(out)]


PARTS = (
    Part(report.CUDA_TESTS, _pytest(("tests/test_cuda.py", "tests/test_cuda_graph.py")), _pytest(CUDA_ONLY_TESTS),
         report.pytest_figures),
    Part(report.KERNELS, _module("benchmarks.kernels", "--batches", "1", "64", "--vocabs", "151936", "--ks", "3",
                                 "--reps", "3", "--logprobs-batches", "1", "64"), None, report.kernels_figures),
    Part(report.DECODE_SMALL,
         _decode("--shape", "qwen2.5-0.5b", "--device", "cuda", "--dtype", "bfloat16", "--batches", "1", "32", "64",
                 "--contexts", "64", "2048"),
         _decode(*DRY_DECODE), report.decode_figures),
    Part(report.DECODE_LARGE,
         _decode("--shape", "qwen2.5-7b", "--device", "cuda", "--dtype", "bfloat16", "--batches", "1", "32",
                 "--contexts", "64", "2048", "--repeats", "2"),
         None, report.decode_figures, dry_skip=f"on the CPU it is {report.DECODE_SMALL}'s dry run, to the letter"),
    Part(report.PROFILE,
         _module("benchmarks.step_profile", "--shape", "qwen2.5-0.5b", "--dtype", "bfloat16", "--device", "cuda",
                 "--batches", "1", "32"),
         _module("benchmarks.step_profile", "--device", "cpu", "--batches", "1", "--steps", "2"),
         report.profile_figures),
    Part(report.METHODS,
         _module("benchmarks.methods", "--device", "cuda", "--batches", "1", "32", "64", "--adaptive-batches", "32",
                 "64", "--methods", *METHOD_NAMES, "--max-tokens", "64", "--prompts", "4", "--reference-prompts", "4"),
         _module("benchmarks.methods", "--device", "cpu", "--batches", "1", "--adaptive-batches", "1",
                 "--methods", *DRY_METHOD_NAMES, "--max-tokens", "2", "--prompts", "2", "--prompt-tokens", "8",
                 "--reference-prompts", "2"),
         report.methods_figures),
    Part(report.MESH,
         _module("benchmarks.speculation", "--device", "cuda", "--methods", "naive", "--prompt-sets", "held-out",
                 "--streams", "1", "8", "32", "--rounds", "2"),
         _module("benchmarks.speculation", "--device", "cpu", "--methods", "naive", "--prompt-sets", "held-out",
                 "--streams", "1", "2", "--rounds", "1", "--requests-per-stream", "1", "--min-requests", "1",
                 "--max-tokens", "2", "--prompt-tokens", "8"),
         report.mesh_figures),
    Part(report.AGREEMENT,
         _module("benchmarks.agreement", "--device", "cuda", "--dtype", "bfloat16", "--batches", "1", "32",
                 "--prompts", "16", "--max-tokens", "64"),
         _module("benchmarks.agreement", "--device", "cpu", "--dtype", "bfloat16", "--batches", "1", "2",
                 "--prompts", "2", "--max-tokens", "2", "--prompt-tokens", "8"),
         report.agreement_figures),
)
PART_NAMES = tuple(p.name for p in PARTS)


@dataclass(frozen=True)
class Outcome:
    status: str
    returncode: int | None
    seconds: float
    stderr_tail: str


def run_part(argv: list[str], timeout_s: float, log_dir: Path, env: dict[str, str]) -> Outcome:
    """`python argv` in the repository, its stdout and stderr in log_dir. It leads a process group of its own,
    and when it ends, or runs past timeout_s, whatever is left of the group is stopped (stop_group): no process
    of one part (a mesh, say, holding GPU memory) outlives it into the next."""
    log_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(log_dir / "stdout.txt", "wb") as stdout, open(log_dir / "stderr.txt", "wb") as stderr:
        proc = subprocess.Popen([sys.executable, *argv], cwd=REPO_ROOT, env=env, stdout=stdout, stderr=stderr,
                                start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            returncode = None
        finally:
            stop_group(proc)  # also when this process is interrupted: no part outlives the check
    status = TIMED_OUT if returncode is None else OK if returncode == 0 else FAILED
    tail = (log_dir / "stderr.txt").read_bytes()[-STDERR_TAIL_CHARS:].decode(errors="replace")
    return Outcome(status, returncode, time.monotonic() - started, tail)


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to proc's process group, SIGKILL to what is left of it after STOP_GRACE_S: the grace lets a mesh's
    launcher stop its services, which run in sessions of their own but die with it."""
    if not _signal_group(proc.pid, signal.SIGTERM):
        return
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline:
        proc.poll()  # reaps the leader, which would stay in its group as a zombie
        if not _signal_group(proc.pid, 0):
            return
        time.sleep(POLL_S)
    _signal_group(proc.pid, signal.SIGKILL)
    proc.wait()


def _signal_group(pgid: int, signum: int) -> bool:
    """Sends signum to the group; False when no process is left in it."""
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        return False
    return True


def machine(dry_run: bool) -> dict:
    """The device, the versions of what runs on it, and the modules the parts need that it lacks."""
    found = {package: _version(package) for package in ("torch", "triton", "transformers")}
    found["missing_modules"] = [name for name in NEEDED_MODULES if util.find_spec(name) is None]
    if dry_run:
        return {"device": "cpu", "device_name": "cpu", **found}
    import torch  # only here: a dry run never touches CUDA, even on a GPU machine

    if not torch.cuda.is_available():
        sys.exit("benchmarks.gpu_check needs a CUDA GPU (torch sees none); on a CPU machine run it with --dry-run")
    props = torch.cuda.get_device_properties(0)
    return {"device": "cuda", "device_name": props.name, "memory_gib": props.total_memory / (1 << 30),
            "cuda": torch.version.cuda, **found}


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _entry(part: Part, dry_run: bool, selected: bool) -> dict:
    return {"status": NOT_RUN, "seconds": None, "budget_s": DRY_BUDGET_S if dry_run else part.budget_s,
            "command": None, "returncode": None, "stderr_tail": "", "figures": None,
            "detail": "not reached" if selected else "not selected (--only)"}


def _record(entry: dict, part: Part, part_dir: Path, outcome: Outcome) -> None:
    """The outcome, the part's figures if it wrote them (a part that failed late may have), and its summary line."""
    entry.update(status=outcome.status, returncode=outcome.returncode, seconds=outcome.seconds,
                 stderr_tail=outcome.stderr_tail)
    lines = [line for line in outcome.stderr_tail.splitlines() if line.strip()]
    last = f"stderr: {lines[-1] if lines else '(empty)'}"
    try:
        entry["figures"] = part.figures(part_dir)
    except report.FIGURE_ERRORS as error:
        entry["detail"] = f"no figures ({type(error).__name__}: {error}); {last}"
        return
    entry["detail"] = report.part_line(part.name, entry["figures"])
    if outcome.status != OK:
        entry["detail"] += f"\n    {last}"


def check(out: Path, dry_run: bool, only: list[str]) -> dict:
    """Runs the selected parts one after another, rewriting both reports after each; returns gpu_check.json."""
    started = time.monotonic()
    total = DRY_TOTAL_BUDGET_S if dry_run else TOTAL_BUDGET_S
    env = dict(os.environ)
    if dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the same CPU run on any machine
    state = {"dry_run": dry_run, "total_budget_s": total, "seconds": 0.0, "machine": machine(dry_run),
             "parts": {p.name: _entry(p, dry_run, p.name in only) for p in PARTS}}
    _write(out, state, started)
    for part in (p for p in PARTS if p.name in only):
        entry, part_dir = state["parts"][part.name], out / part.name
        shutil.rmtree(part_dir, ignore_errors=True)  # no file of an earlier run may pass for this run's
        command = part.dry_command if dry_run else part.command
        timeout = min(entry["budget_s"], total - (time.monotonic() - started) - STOP_GRACE_S)
        if command is None:
            entry.update(status=SKIPPED, detail=part.dry_skip)
        elif timeout <= 0:
            entry.update(detail="not run: no time left of the check's total budget")
        else:
            entry.update(status=RUNNING, command=shlex.join(["python", *command(part_dir)]), detail="")
            _write(out, state, started)  # a check stopped from outside shows which part it was in
            _record(entry, part, part_dir, run_part(command(part_dir), timeout, part_dir, env))
            print(f"{part.name}: {entry['status']} in {entry['seconds']:.1f} s", flush=True)
        _write(out, state, started)
    return state


def _write(out: Path, state: dict, started: float) -> None:
    """Both reports as they stand."""
    state["seconds"] = time.monotonic() - started
    figures = {name: part["figures"] for name, part in state["parts"].items() if part["figures"] is not None}
    state["targets"] = report.judge_targets(figures, state["dry_run"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(state, indent=2) + "\n")
    (out / "summary.txt").write_text(report.summary_text(state))


def _stop(signum: int, _frame: object) -> None:
    """SIGTERM as an exit, so that the running part's process group is stopped on the way out."""
    raise SystemExit(f"gpu_check: stopped by signal {signum}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="where gpu_check.json, summary.txt and the parts go")
    parser.add_argument("--dry-run", action="store_true", help="the same parts on the CPU with tiny shapes")
    parser.add_argument("--only", nargs="+", choices=PART_NAMES, default=list(PART_NAMES), help="run these parts")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _stop)
    state = check(args.out.resolve(), args.dry_run, args.only)
    print(report.summary_text(state), end="")
    not_ok = [name for name in args.only if state["parts"][name]["status"] not in (OK, SKIPPED)]
    if not_ok:
        sys.exit(f"gpu_check: not ok: {', '.join(not_ok)}")


if __name__ == "__main__":
    main()
