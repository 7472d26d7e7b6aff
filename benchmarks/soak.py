"""The mesh under load and faults: concurrent streams from locust for a while, clients that leave mid-stream, and
SIGKILL of a worker, a detokenizer or NATS under load.

    python -m benchmarks.soak [--streams 32] [--duration 600] [--max-tokens 128] [--workers 1] [--detokenizers 1]
        [--disconnects N [--leavers 8] [--disconnect-max-delay 1.0]] [--kill worker|detokenizer|nats [--kill-at S]]
        [--out bench-out/soak]

It starts the mesh as `specmesh up` does (services/mesh_process.py: NATS, gateway, workers, detokenizers as
processes) and runs locust (the [load] extra; its users are benchmarks/load/locustfile.py) in a process of its own:
--streams users each keep one streaming completion in flight, back to back, for --duration seconds; prompts are
openings of held-out standard-library files, half greedy and half sampled with one of a few seeds, EOS ignored.
--disconnects N adds --leavers users that send the same requests and close their connection after a random
0..--disconnect-max-delay seconds (before the response, before the first token or mid-stream) until N have left;
the run lasts until both are done. --kill sends SIGKILL to the first worker, the detokenizer or NATS --kill-at
seconds into the load (`specmesh up` restarts it) and reports the stall: the longest wait of any stream that
ended after the kill (a first token included), and how many of the streams in flight then were served.

After the load, every service's gauges of what it holds for requests (benchmarks/load/processes.py: HELD) must
return to zero. Reported (printed, and written to --out/soak.json): errors (must be zero), requests, tokens/s,
p50/p99 time to first token and inter-token latency (the gap between chunks as the client receives them), outputs
that differ between equal requests (greedy, or sampled with the same seed: must be zero), disconnects, the stall,
and each process's resident memory at the start, at its peak (sampled every few seconds) and at the end.
The exit status is 1 when any check failed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.load import processes
from benchmarks.load.figures import LoadFigures, StallFigures, load_figures, stall_figures
from benchmarks.load.plan import LoadPlan, read_records
from services.mesh_process import Mesh, start_mesh
from services.worker.demo_model.data import load_corpus
from shared.config import DEFAULT_MODEL_DIR

REPO = Path(__file__).resolve().parent.parent
LOCUSTFILE = Path(__file__).resolve().parent / "load" / "locustfile.py"
PROMPT_CHARS = 240  # each prompt is the opening of a held-out file, this long
LEAVE_MAX_TOKENS = 512  # a leaving client's request: far longer than its stay, so it leaves mid-stream
SEEDS = [1, 2, 3]  # few, so that equal sampled requests recur and their outputs can be compared
SAMPLED_TEMPERATURE = 0.8
LOCUST_START_TIMEOUT_S = 60.0
LOCUST_EXIT_MARGIN_S = 360.0  # past the duration: the disconnects still to make and the last streams to end
SAMPLE_EVERY_S = 5.0  # memory and kill checks while the load runs
MIB = 1024 * 1024
RESTART_MARKS = ("exited with status", "restarted as pid")
# Kills after which the streams in flight may end with a clear error rather than be served: a detokenizer holds
# its requests' text state, and frames published while NATS is down are lost. None may break or hang.
KILLS_ENDING_STREAMS = ("detokenizer", "nats")
MAX_STALL_S = 10.0  # issue 10: after a kill, nothing waits longer than this


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--streams", type=int, default=32, help="concurrent streaming completions")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per completion (EOS ignored)")
    parser.add_argument("--prompts", type=int, default=16, help="distinct prompts")
    parser.add_argument("--sampled-share", type=float, default=0.5, help="share of requests sampled with a seed")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--detokenizers", type=int, default=1)
    parser.add_argument(
        "--max-num-seqs", type=int, default=None,
        help="each worker's batch (default: every user's request in one batch, the leaving clients' included)",
    )
    parser.add_argument("--torch-threads", type=int, default=1, help="each worker's torch threads (1 suits 2 cores)")
    parser.add_argument("--mesh-arg", action="append", default=[], help="one more `specmesh up` argument (repeatable)")
    parser.add_argument("--disconnects", type=int, default=0, help="clients that leave mid-stream")
    parser.add_argument("--leavers", type=int, default=8, help="users making the disconnects, beside the streams")
    parser.add_argument("--disconnect-max-delay", type=float, default=1.0, help="a leaving client's longest stay, s")
    parser.add_argument("--kill", choices=processes.KILLABLE, default=None, help="SIGKILL this process under load")
    parser.add_argument("--kill-at", type=float, default=None, help="seconds into the load (default: half-way)")
    parser.add_argument("--max-stall", type=float, default=MAX_STALL_S, help="the longest wait a kill may cause, s")
    parser.add_argument("--settle-timeout", type=float, default=30.0, help="seconds for the gauges to reach zero")
    parser.add_argument("--out", type=Path, default=Path("bench-out/soak"))
    args = parser.parse_args(argv)
    if args.kill_at is None:
        args.kill_at = args.duration / 2
    if args.kill and not 0 < args.kill_at < args.duration:
        parser.error(f"--kill-at must lie inside the load's {args.duration} s, got {args.kill_at}")
    return args


def held_out_prompts(count: int) -> list[str]:
    openings = [text[:PROMPT_CHARS] for text in load_corpus().held_out if len(text) >= PROMPT_CHARS]
    return openings[:count]


def users(args: argparse.Namespace) -> int:
    return args.streams + (args.leavers if args.disconnects else 0)


def mesh_arguments(args: argparse.Namespace) -> list[str]:
    return [
        "--workers", str(args.workers), "--detokenizers", str(args.detokenizers),
        "--max-num-seqs", str(args.max_num_seqs or users(args)), "--torch-threads", str(args.torch_threads),
        *args.mesh_arg,
    ]


def _wait_for_metrics_urls(mesh: Mesh, args: argparse.Namespace) -> dict[str, str]:
    expected = 1 + args.workers + args.detokenizers  # the gateway's, each worker's and each detokenizer's
    deadline = time.monotonic() + LOCUST_START_TIMEOUT_S
    while len(urls := processes.metrics_urls(mesh)) < expected:
        if time.monotonic() > deadline:
            raise RuntimeError("specmesh up printed no metrics URLs:\n" + "".join(mesh.log[-20:]))
        time.sleep(0.1)
    return urls


def _start_locust(mesh: Mesh, plan_path: Path, plan: LoadPlan, work: Path) -> subprocess.Popen:
    users = plan.streams + plan.leavers
    cmd = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "-u", str(users), "-r", str(users),
        "-H", mesh.base_url.removesuffix("/v1"), "--soak-plan", str(plan_path), "--only-summary",
        "--json-file", str(work / "locust"), "--loglevel", "WARNING", "StreamUser",
    ]
    if plan.leavers:
        cmd.append("LeaveUser")
    log = open(work / "locust.log", "w")
    return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)


def _wait_started(locust: subprocess.Popen, started: Path, work: Path) -> float:
    deadline = time.monotonic() + LOCUST_START_TIMEOUT_S
    while not started.exists() or not started.read_text():
        if locust.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("locust did not start:\n" + (work / "locust.log").read_text()[-3000:])
        time.sleep(0.05)
    return float(started.read_text())


def _sample_peaks(peaks: dict[str, int], mesh: Mesh, urls: dict[str, str]) -> None:
    for role, rss in processes.memory(processes.roles(mesh, urls)).items():
        if rss is not None:
            peaks[role] = max(peaks.get(role, 0), rss)


def _mib(value: int | None) -> float | None:
    return None if value is None else round(value / MIB, 1)


def _locust_totals(work: Path) -> dict[str, int]:
    path = work / "locust.json"
    stats = json.loads(path.read_text()) if path.exists() else []
    return {
        "num_requests": sum(entry["num_requests"] for entry in stats),
        "num_failures": sum(entry["num_failures"] for entry in stats),
    }


def _plan(args: argparse.Namespace, work: Path) -> LoadPlan:
    return LoadPlan(
        model=args.model.name, prompts=held_out_prompts(args.prompts), max_tokens=args.max_tokens,
        streams=args.streams, duration_s=args.duration, sampled_share=args.sampled_share, seeds=SEEDS,
        temperature=SAMPLED_TEMPERATURE, disconnects=args.disconnects,
        leavers=users(args) - args.streams, disconnect_max_delay_s=args.disconnect_max_delay,
        leave_max_tokens=LEAVE_MAX_TOKENS, records_path=str(work / "records.jsonl"),
        started_path=str(work / "started"),
    )


def _drive(
    args: argparse.Namespace, mesh: Mesh, urls: dict[str, str], locust: subprocess.Popen, load_started: float,
    peaks: dict[str, int],
) -> tuple[str, float] | None:
    """Watches the load until locust exits: samples memory, and kills --kill's process at --kill-at. Returns the
    killed role and when it was killed."""
    killed = None
    kill_at = load_started + args.kill_at if args.kill else float("inf")
    deadline = load_started + args.duration + LOCUST_EXIT_MARGIN_S
    while locust.poll() is None and time.monotonic() < deadline:
        _sample_peaks(peaks, mesh, urls)
        if killed is None and time.monotonic() >= kill_at:
            role, pid = processes.kill_target(processes.roles(mesh, urls), args.kill)
            processes.kill(pid)
            killed = (role, time.monotonic())
        wake = kill_at if killed is None else float("inf")
        time.sleep(max(0.0, min(SAMPLE_EVERY_S, wake - time.monotonic(), deadline - time.monotonic())))
    return killed


def _checks(args: argparse.Namespace, report: dict, figures: LoadFigures, stall: StallFigures | None) -> dict:
    locust_agrees = report["locust"]["num_failures"] == figures.errors + figures.disconnect_errors
    if args.kill in KILLS_ENDING_STREAMS:
        errors = {"only clear errors (none broke, stalled or ran short)": not figures.unclear_errors and locust_agrees}
    else:
        errors = {"no errors": figures.errors == 0 and figures.disconnect_errors == 0 and locust_agrees}
    checks = errors | {
        "equal requests, equal outputs": figures.divergent_outputs == 0,
        "every disconnect made before its stream ended": figures.disconnects == args.disconnects,
        "gauges back to zero": report["idle_after_load"]["all_zero"],
        "the mesh stopped cleanly": report["mesh_exit_status"] == 0,
    }
    if stall is not None:
        checks["the stall within --max-stall"] = (stall.stall_s or 0.0) <= args.max_stall
        if args.kill not in KILLS_ENDING_STREAMS:
            checks["every stream in flight at the kill served"] = stall.in_flight_served == stall.in_flight_at_kill
    return checks


def run_soak(args: argparse.Namespace) -> dict:
    """Runs the whole soak and returns its report; `report["ok"]` says whether every check held."""
    with tempfile.TemporaryDirectory(prefix="specmesh-soak-") as tmp:
        work = Path(tmp)
        plan = _plan(args, work)
        plan_path = work / "plan.json"
        plan.save(plan_path)
        mesh = start_mesh(work, *mesh_arguments(args), model=args.model)
        locust = None
        try:
            urls = _wait_for_metrics_urls(mesh, args)
            start_rss = processes.memory(processes.roles(mesh, urls))
            peaks: dict[str, int] = {}
            locust = _start_locust(mesh, plan_path, plan, work)
            load_started = _wait_started(locust, Path(plan.started_path), work)
            killed = _drive(args, mesh, urls, locust, load_started, peaks)
            if locust.poll() is None:
                locust.kill()
            locust_status = locust.wait()
            records = read_records(Path(plan.records_path))
            load_ended = max((r.sent + (r.ended or 0.0) for r in records), default=load_started)
            idle, settle_s = processes.wait_idle(urls, args.settle_timeout)
            end_rss = processes.memory(processes.roles(mesh, urls))
        finally:
            if locust is not None and locust.poll() is None:
                locust.kill()
            mesh_status = mesh.stop()
        figures = load_figures(records, load_ended - load_started)
        stall = stall_figures(records, killed[0], killed[1], load_started) if killed else None
        report = {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "options": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "mesh_arguments": mesh_arguments(args),
            "load_s": round(load_ended - load_started, 1),
            "load": figures.to_json(),
            "locust": _locust_totals(work) | {"exit_status": locust_status},
            "stall": stall.to_json() if stall else None,
            "idle_after_load": {
                "all_zero": all(v == 0 for v in idle.values()), "settle_s": round(settle_s, 2), "gauges": idle,
            },
            "memory_mib": {
                role: {
                    "start": _mib(start_rss.get(role)), "peak": _mib(peaks.get(role)), "end": _mib(end_rss.get(role)),
                }
                for role in sorted(start_rss.keys() | end_rss.keys())
            },
            "restarts": [line.strip() for line in mesh.log if any(mark in line for mark in RESTART_MARKS)],
            "tracebacks": sum("Traceback" in line for line in mesh.log),
            "mesh_exit_status": mesh_status,
        }
    report["checks"] = _checks(args, report, figures, stall)
    report["ok"] = all(report["checks"].values())
    return report


def summary(report: dict) -> str:
    load = report["load"]
    lines = [
        f"{load['requests']} requests in {report['load_s']} s, {load['errors']} errors, {load['tokens_per_s']} tok/s; "
        f"TTFT p50/p99 {load['ttft_ms']['p50']} / {load['ttft_ms']['p99']} ms; "
        f"ITL p50/p99 {load['itl_ms']['p50']} / {load['itl_ms']['p99']} ms; "
        f"divergent outputs {load['divergent_outputs']}",
    ]
    if report["options"]["disconnects"]:
        phases = ", ".join(f"{n} {phase.replace('_', ' ')}" for phase, n in load["disconnects_by_phase"].items())
        lines.append(
            f"disconnects {load['disconnects']} ({phases}; {load['disconnects_finished_first']} more came after the "
            f"end), {load['disconnect_errors']} errors before leaving"
        )
    if report["stall"]:
        s = report["stall"]
        lines.append(f"killed {s['killed']} at {s['at_s']} s: stall {s['stall_s']} s (longest before "
                     f"{s['longest_gap_before_s']} s); in flight {s['in_flight_served']}/{s['in_flight_at_kill']} "
                     f"served, started after {s['started_after_served']}/{s['started_after']}")
    idle = report["idle_after_load"]
    lines.append(f"gauges back to zero: {idle['all_zero']} after {idle['settle_s']} s")
    lines += [
        f"  {role}: RSS {m['start']} -> peak {m['peak']} -> {m['end']} MiB" for role, m in report["memory_mib"].items()
    ]
    lines += [f"check {name}: {'OK' if ok else 'FAILED'}" for name, ok in report["checks"].items()]
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    report = run_soak(args)
    report["command"] = "python -m benchmarks.soak " + " ".join(sys.argv[1:])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(report, indent=2) + "\n")
    print(summary(report))
    print(f"wrote {args.out / 'soak.json'}")
    if not report["ok"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
