"""`specmesh up` on its defaults against hand-picked flags, under a load generator nobody here wrote (aiperf or
guidellm):

    pip install aiperf            # in a virtual environment of its own: its dependencies are not specmesh's
    python -m benchmarks.defaults --aiperf /path/to/aiperf [--configs defaults manual "no drafts" "torch threads"
        "batch of 8"]
        [--concurrency 1 8] [--rounds 2] [--requests 6] [--isl 128] [--osl 128] [--busy both|no]
        [--endpoint-type completions|chat|responses] [--out bench-out/defaults]
    pip install guidellm          # likewise
    python -m benchmarks.defaults --load-generator guidellm --guidellm /path/to/guidellm [...]

Configurations, each a `specmesh up` with these options and nothing else:
- defaults: no option at all, what a newcomer runs (services/cpu_plan.py chooses the CPUs);
- manual: `--manual` (default `--torch-threads 1 --engine-cpus 0`, README's tuned flags of the 2-core machine);
- no drafts: the defaults with plain decoding (`--speculative-config '{"method": "naive"}'`): what the default
  speculation gains or costs under aiperf's requests, which sample at temperature 1 (aiperf sends none, and the
  API's default is 1);
- torch threads: `--engine-cpus none --torch-threads 0`, the defaults before the CPU plan: torch's one thread per
  core, every process where the kernel puts it;
- batch of 8: `--max-num-seqs 8`, the defaults before a worker batched 64 sequences (past 8 streams the rest waited
  at the gateway).
Each is measured alone and beside a busy process (a pure-Python loop, on no particular CPU: a user's other program;
`--busy no`: alone only). For each point aiperf runs `profile --endpoint-type completions --streaming` with
synthetic prompts of --isl tokens (aiperf's own text, which the demo model never saw) and --osl output tokens with
`ignore_eos`, at the given concurrency, after warm-up requests; guidellm runs `run` with a `concurrent` profile over
its `synthetic_text` data through the chat completions endpoint (its default), its warm-up requests left out of its
figures. Neither sends a temperature, so requests sample at the API's default of 1. Figures are the load generator's
own: inter-token latency mean, time to first token mean, output tokens/s. Every configuration's mesh is up for the
whole run and the configurations take turns point by point (`run_all`); each figure is the median over rounds.
Beside them, the CPU time each of the mesh's processes took per output token during the point (engine, worker loop,
gateway, detokenizer, NATS; benchmarks/process_cpu.py, Linux), and the rest of the machine's (the load generator,
chiefly), per requested output token, warm-up requests included.
Prints a table with each configuration's ratio to manual and the CPU table, writes defaults.json, defaults.png and
table.md to --out.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from benchmarks.plot import plot_defaults, save_report
from benchmarks.process_cpu import OTHER, OUTSIDE, ROLES, CpuMeter
from services.mesh_process import start_mesh
from shared.config import DEFAULT_MODEL_DIR

MANUAL_FLAGS = "--torch-threads 1 --engine-cpus 0"
CONFIGS = {
    "defaults": "", "manual": MANUAL_FLAGS, "no drafts": """--speculative-config '{"method": "naive"}'""",
    "torch threads": "--engine-cpus none --torch-threads 0",
    "batch of 8": "--max-num-seqs 8",  # the default before a worker batched 64
}
CONCURRENCY = (1, 8)
ROUNDS = 2
REQUESTS_PER_STREAM = 6
WARMUP_PER_STREAM = 1
ISL = OSL = 128
LOAD_TIMEOUT_S = 600
SPIN_UP_S = 0.5  # lets the busy process reach its core before the load generator starts
FIGURES = {  # aiperf's JSON key -> our name
    "inter_token_latency": "itl_ms",
    "time_to_first_token": "ttft_ms",
    "output_token_throughput": "output_tokens_per_s",
}
GUIDELLM_FIGURES = {  # guidellm's metric -> our name
    "inter_token_latency_ms": "itl_ms",
    "time_to_first_token_ms": "ttft_ms",
    "output_tokens_per_second": "output_tokens_per_s",
}


@contextmanager
def busy_process(busy: bool) -> Iterator[None]:
    """A process spinning in pure Python for the block's duration, placed by the kernel; nothing when not busy."""
    if not busy:
        yield
        return
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(SPIN_UP_S)
        yield
    finally:
        spinner.kill()
        spinner.wait()


def run_load_generator(name: str, cmd: list[str], export: Path) -> dict:
    """Runs a load generator's command to its end; the JSON report it exported, or RuntimeError with its output."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=LOAD_TIMEOUT_S)
    if done.returncode != 0 or not export.is_file():
        raise RuntimeError(f"{name} failed ({done.returncode}): {done.stderr[-2000:] or done.stdout[-2000:]}")
    return json.loads(export.read_text())


def aiperf_point(args: argparse.Namespace, base_url: str, model: str, concurrency: int, out: Path) -> dict:
    """One aiperf profile against the mesh at `concurrency`; its figures (module docstring)."""
    cmd = [
        args.aiperf, "profile", "--model", model, "--url", base_url.removesuffix("/v1"),
        "--endpoint-type", args.endpoint_type, "--streaming", "--tokenizer", str(args.model),
        "--isl", str(args.isl), "--isl-stddev", "0", "--osl", str(args.osl), "--osl-stddev", "0",
        "--extra-inputs", "ignore_eos:true", "--concurrency", str(concurrency),
        "--request-count", str(args.requests * concurrency),
        "--warmup-request-count", str(WARMUP_PER_STREAM * concurrency),
        "--artifact-dir", str(out), "--ui-type", "none",
    ]
    report = run_load_generator("aiperf", cmd, out / "profile_export_aiperf.json")
    if report.get("error_summary"):
        raise RuntimeError(f"aiperf saw failed requests: {report['error_summary']}")
    return {ours: report[key]["avg"] for key, ours in FIGURES.items()}


def guidellm_point(args: argparse.Namespace, base_url: str, model: str, concurrency: int, out: Path) -> dict:
    """One guidellm benchmark against the mesh at `concurrency`; its figures (module docstring)."""
    warmup = WARMUP_PER_STREAM * concurrency
    export = out / "guidellm.json"
    cmd = [
        args.guidellm, "run", "--backend", f"kind=openai_http,target={base_url.removesuffix('/v1')}",
        "--profile", f"kind=concurrent,streams={concurrency},warmup={warmup}",
        "--constraint", f"kind=max_requests,count={args.requests * concurrency + warmup}",
        "--data", f"kind=synthetic_text,prompt_tokens={args.isl},output_tokens={args.osl}",
        "--tokenizer", f"kind=huggingface_auto,model={args.model}",
        "--output", f"kind=json,path={export}", "--disable-console",
    ]
    metrics = run_load_generator("guidellm", cmd, export)["benchmarks"][0]["metrics"]
    if metrics["request_totals"]["errored"]:
        raise RuntimeError(f"guidellm saw failed requests: {metrics['request_totals']}")
    return {ours: metrics[key]["successful"]["mean"] for key, ours in GUIDELLM_FIGURES.items()}


LOAD_POINTS = {"aiperf": aiperf_point, "guidellm": guidellm_point}


def run_all(args: argparse.Namespace, tmp: Path, results: dict[tuple, list[dict]]) -> None:
    """Every configuration's mesh up at once, each idle while another serves; each point then runs once per round
    on every mesh in turn, so that the machine's drift within minutes (a tenth and more on a shared 2-core machine)
    reaches every configuration alike and no mesh's start-up luck decides a figure."""
    meshes = {}
    try:
        for name, flags in args.configs.items():
            meshes[name] = start_mesh(tmp / name.replace(" ", "-"), *shlex.split(flags), model=args.model)
            args.cpu_plans[name] = meshes[name].cpu_plan
        for _ in range(args.rounds):
            for busy in (False, True) if args.busy == "both" else (False,):
                for concurrency in args.concurrency:
                    for name, mesh in meshes.items():
                        meter = CpuMeter(mesh.proc.pid)
                        with busy_process(busy):  # a directory of its own: a stale export never passes for this one
                            meter.start()
                            point = LOAD_POINTS[args.load_generator](
                                args, mesh.base_url, mesh.model, concurrency, Path(tempfile.mkdtemp(dir=tmp))
                            )
                            seconds = meter.stop()
                        tokens = (args.requests + WARMUP_PER_STREAM) * concurrency * args.osl
                        point["cpu_us_per_token"] = {role: 1e6 * s / tokens for role, s in seconds.items()}
                        print(json.dumps({"config": name, "busy": busy, "concurrency": concurrency, **point}),
                              flush=True)
                        results.setdefault((name, busy, concurrency), []).append(point)
    finally:
        for mesh in meshes.values():
            mesh.stop()


def summarise(results: dict[tuple, list[dict]]) -> list[dict]:
    rows = []
    for (name, busy, concurrency), points in results.items():
        row = {"config": name, "busy": busy, "concurrency": concurrency, "rounds": points}
        row.update({figure: statistics.median(p[figure] for p in points) for figure in FIGURES.values()})
        roles = {role for p in points for role in p["cpu_us_per_token"]}
        row["cpu_us_per_token"] = {
            role: statistics.median(p["cpu_us_per_token"].get(role, 0.0) for p in points) for role in roles
        }
        rows.append(row)
    for row in rows:
        manual = next(r for r in rows if r["config"] == "manual" and r["busy"] == row["busy"]
                      and r["concurrency"] == row["concurrency"])
        row["itl_over_manual"] = row["itl_ms"] / manual["itl_ms"]
        row["tokens_per_s_over_manual"] = row["output_tokens_per_s"] / manual["output_tokens_per_s"]
    return sorted(rows, key=lambda r: (r["busy"], r["concurrency"], list(CONFIGS).index(r["config"])))


def markdown_table(rows: list[dict], configs: dict[str, str]) -> str:
    lines = [
        "| configuration | busy process | concurrency | ITL avg ms | TTFT avg ms | output tok/s | ITL / manual "
        "| tok/s / manual |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        flags = configs[r["config"]] or "no options"
        lines.append(
            f"| {r['config']} (`{flags}`) | {'yes' if r['busy'] else 'no'} | {r['concurrency']} | {r['itl_ms']:.2f} "
            f"| {r['ttft_ms']:.1f} | {r['output_tokens_per_s']:.0f} | {r['itl_over_manual']:.2f} "
            f"| {r['tokens_per_s_over_manual']:.2f} |"
        )
    return "\n".join(lines)


CPU_COLUMNS = list(dict.fromkeys(role for _, role in ROLES)) + [OTHER, OUTSIDE]


def cpu_table(rows: list[dict]) -> str:
    """Each point's CPU time per output token (us), by process role (benchmarks/process_cpu.py)."""
    lines = [
        "| configuration | busy process | concurrency | " + " | ".join(CPU_COLUMNS) + " |",
        "|---|---|---:|" + "---:|" * len(CPU_COLUMNS),
    ]
    for r in rows:
        cells = " | ".join(f"{r['cpu_us_per_token'].get(role, 0.0):.0f}" for role in CPU_COLUMNS)
        lines.append(f"| {r['config']} | {'yes' if r['busy'] else 'no'} | {r['concurrency']} | {cells} |")
    return "\n".join(lines)


def load_generator_version(args: argparse.Namespace) -> str:
    command = args.aiperf if args.load_generator == "aiperf" else args.guidellm
    try:
        done = subprocess.run([command, "--version"], capture_output=True, text=True)
    except FileNotFoundError:
        raise SystemExit(f"no {args.load_generator} command at {command!r}: pass --{args.load_generator} PATH") \
            from None
    return f"{args.load_generator} {done.stdout.strip().split()[-1]}" if done.stdout.strip() else args.load_generator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load-generator", choices=list(LOAD_POINTS), default="aiperf")
    parser.add_argument("--aiperf", default="aiperf", help="the aiperf command (its own virtual environment's)")
    parser.add_argument("--endpoint-type", choices=["completions", "chat", "responses"], default="completions",
                        help="the API aiperf drives: /v1/completions, /v1/chat/completions or /v1/responses")
    parser.add_argument("--guidellm", default="guidellm", help="the guidellm command (its own virtual environment's)")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--manual", default=MANUAL_FLAGS, help="the hand-picked flags to compare the defaults with")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS),
                        help="the configurations to run (manual is always run: the ratios are to it)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCY))
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--requests", type=int, default=REQUESTS_PER_STREAM, help="timed requests per stream")
    parser.add_argument("--isl", type=int, default=ISL, help="synthetic prompt tokens")
    parser.add_argument("--osl", type=int, default=OSL, help="output tokens per request")
    parser.add_argument("--busy", choices=["both", "no"], default="both",
                        help="measure beside a busy process too (both) or alone only (no)")
    parser.add_argument("--out", type=Path, default=Path("bench-out/defaults"))
    args = parser.parse_args()
    args.configs = {name: args.manual if name == "manual" else flags for name, flags in CONFIGS.items()
                    if name in args.configs or name == "manual"}
    args.cpu_plans = {}
    version = load_generator_version(args)  # before the run: a wrong path fails now, not after every point
    results: dict[tuple, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        run_all(args, Path(tmp), results)
    rows = summarise(results)
    text = "\n\n".join(
        (markdown_table(rows, args.configs), "CPU us per output token, by process:", cpu_table(rows))
    )
    print("\n" + text)
    report = {
        "model": str(args.model), "isl": args.isl, "osl": args.osl, "requests_per_stream": args.requests,
        "rounds": args.rounds, "configs": args.configs, "cpu_plans": args.cpu_plans,
        "defaults_cpu_plan": args.cpu_plans.get("defaults", "not run"),
        "load_generator": version,
        "endpoint_type": args.endpoint_type if args.load_generator == "aiperf" else "chat",
        "rows": rows,
    }
    save_report(args.out, "defaults", report, text, plot_defaults)


if __name__ == "__main__":
    main()
