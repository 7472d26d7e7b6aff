"""Engine against mesh: tokens/s of the engine in-process and through the whole mesh, and the mesh's inter-token
latency beside the engine's step time, for naive and ngram k=3 at 1, 8 and 32 concurrent streams.

    python -m benchmarks.speculation [--device cpu|cuda] [--streams 1 8 32] [--max-tokens 128] [--requests-per-stream 4]
                                     [--min-requests 16] [--rounds 3] [--torch-threads N] [--engine-cpus auto|none|0] [--prompt-tokens 96]
                                     [--methods naive ngram] [--prompt-sets held-out self-repeating]
                                     [--out bench-out/speculation]

Two prompt sets: openings (--prompt-tokens, default 96) of held-out standard-library files the demo model never trained on, and a
self-repeating prompt (benchmarks/decode.py's two import lines written sixteen times) on which prompt lookup pays.
Each run serves streams x --requests-per-stream greedy requests of --max-tokens tokens (EOS ignored), and at least
--min-requests (MIN_REQUESTS), so that a point lasts long enough for a request's fixed start-up and the machine's
drift to even out, and a few streams still read enough of the held-out text:

- engine: one Engine with max_num_seqs = streams; every request added at once and stepped until done;
  tokens/s = tokens / wall time; mean step time = that wall time / steps.
- mesh: `specmesh up` (NATS, gateway, worker, detokenizer as processes; one mesh per method, its
  max_num_seqs the largest --streams), driven by a light SSE client (aiohttp, not the openai client, whose parsing
  would take CPU time from the mesh on a small machine) that keeps `streams` streaming completions in flight;
  tokens/s = tokens / wall time from the first request to the last stream's end; decode tokens/s = the tokens after
  each stream's first chunk over the time from its first chunk to its last, summed over the streams (the rate once
  prefill is done, comparable with benchmarks/decode.py's transformers figures at the same context). Sums, not a
  mean of per-stream rates: a client that falls behind reads many tokens in its first chunk, and that stream's own
  rate (the few tokens left over a few milliseconds) would swamp the mean.
- engine and mesh take turns: per run, each serves the requests once untimed (first-use costs such as Triton
  compiling kernels for new shapes are paid then), then --rounds timed mesh passes alternate with --rounds + 1
  engine passes (engine, mesh, engine, ..., mesh, engine; the engine while the mesh idles, nothing else between
  them). Each figure is the median of its passes; a mesh pass's mesh / engine is its rate over the mean of the two
  engine passes around it, and the row's the median of those. A shared machine's speed drifts by tens of percent
  within minutes (seen here: the same engine pass at 1.5 and 3 ms a step twenty minutes apart, and 10% from one
  pass to the next); engine passes on both sides of each mesh pass cancel a drift that is steady over the two.
  The engine beside a busy core and transformers are timed after, so that no pass of theirs (transformers runs in
  this process, its memory beside the engine's) comes between an engine pass and its mesh pass.
- engine beside a busy core: --rounds passes of the engine while a process spins on another core. The mesh
  must run its other processes (NATS, gateway, detokenizer, the worker's event loop, the client) on the other
  cores; on some 2-core virtual machines a core's work slows its neighbour's (seen on one: 12-22% with a spinning
  loop, shared host core or clock; on another, nothing measurable), and there this figure is what any mesh of
  processes could reach.
- --engine-cpus and --torch-threads are `specmesh up`'s (services/cpu_plan.py), default auto as there: the mesh
  gets them as given, so by default it runs on its own defaults; the in-process engine and transformers run on the
  CPUs and threads the plan gives one worker's engine, and this client and the spinning process on the rest.
- transformers (rows of one stream): --rounds passes of transformers `generate` on the same prompts, greedy
  beside naive and prompt lookup with ngram's k beside ngram; its decode rate (tokens after the first over
  generate(N) minus generate(1), as benchmarks/decode.py) is comparable with the mesh's decode rate.
- inter-token latency (mesh): a chunk that brings n tokens brings them at once, so each of its tokens counts once
  with the gap between its chunk's arrival and the previous chunk's, divided by n (what the gateway's
  specmesh_gateway_inter_token_latency_seconds measures); the first chunk of a stream has no gap. A chunk's tokens
  are found from its text: token i has arrived once the streamed text is as long as the engine's tokens 0..i
  decoded. p50 and p99 are over every token of every stream of the run.

Greedy outputs must agree: naive and ngram on the engine, and the mesh's text with the engine's tokens decoded
(exit status 1 otherwise). --methods and --prompt-sets run some of them only. Writes speculation.json and
speculation.png to --out and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from benchmarks import shape
from benchmarks.decode import LOOKUP_TOKENS, SELF_REPEATING_TEXT, hf_decode
from benchmarks.mesh_client import Stream, first_chunk_tokens, inter_token_gaps, mesh_streams, token_ends
from benchmarks.methods import GREEDY, load_prompts
from shared.seeds import worker_seed
from benchmarks.plot import plot_mesh, save_report
from services import cpu_plan
from services.cpu_affinity import format_cpu_list, pin
from services.detokenizer.incremental import TokenTable
from services.mesh_process import start_mesh
from services.worker.engine.engine import Engine, EngineStats
from shared.config import DEFAULT_MODEL_DIR, EngineConfig, SpeculativeConfig
from shared.schemas import SamplingParams, WorkRequest
from shared.tokenizer import Tokenizer

METHODS = {
    "naive": {"method": "naive"},
    "ngram k=3": {"method": "ngram", "num_speculative_tokens": 3},
    "mtp k=3 steps=3": {"method": "mtp", "num_speculative_tokens": 3, "num_model_steps": 3},
    "suffix k=3": {"method": "suffix", "num_speculative_tokens": 3},
    "draft_model k=3": {"method": "draft_model", "num_speculative_tokens": 3},  # models/specmesh-demo-draft
    "eagle3 k=3": {"method": "eagle3", "num_speculative_tokens": 3},  # models/specmesh-demo-eagle3
}
MODEL_DRAFTERS = ("mtp", "draft_model", "eagle3")  # drafts with a real q
STREAMS = (1, 8, 32)
PROMPT_TOKENS = 96
HELD_OUT = "held-out"
SELF_REPEATING = "self-repeating"
REQUESTS_PER_STREAM = 4  # each stream serves this many requests, one after the other
# A run serves at least this many requests, its streams sharing them. Four requests at one stream are 512 tokens of
# the first four held-out openings, too few to speak for held-out text: the demo draft model agreed with the target
# on 0.57 of the greedy tokens after those four and on 0.78 after the first 64.
MIN_REQUESTS = 16
# Each run is served this many times before the timed passes, on the same engine or mesh: the clock starts once
# first-use costs (Triton compiling a kernel for a shape, allocators growing) are paid, on both sides alike.
UNTIMED_PASSES = 1
ROUNDS = 3  # timed passes of each side, taking turns
SPIN_UP_S = 0.2  # for the spinning process to start before the timed pass
DEFAULT_MAX_TOKENS = 128
PERCENTILES = (50, 99)


@dataclass
class Row:
    prompts: str
    method: str
    streams: int
    requests: int
    rounds: int
    engine_tokens_per_s: float
    engine_mean_step_ms: float
    mean_acceptance_length: float | None  # None: the method drafts nothing
    engine_beside_busy_core_tokens_per_s: float | None = None
    mesh_tokens_per_s: float | None = None
    mesh_over_engine: float | None = None
    mesh_over_engine_rounds: list[float] = field(default_factory=list)  # each round's, in order
    engine_tokens_per_s_passes: list[float] = field(default_factory=list)  # in order, around the mesh's passes
    mesh_itl_p50_ms: float | None = None
    mesh_itl_p99_ms: float | None = None
    mesh_decode_tokens_per_s: float | None = None
    transformers_decode_tokens_per_s: float | None = None  # greedy beside naive, prompt lookup beside ngram
    outputs: list[list[int]] = field(default_factory=list, repr=False)
    mismatched: list[int] = field(default_factory=list, repr=False)  # requests whose mesh text differed

    def figures(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in ("outputs", "mismatched")}


def bracketed_ratios(baseline_rates: list[float], rates: list[float]) -> list[float]:
    """Pass i of rates over the mean of baseline passes i and i + 1, the two around it (one more baseline pass than
    passes): what cancels a drift that is steady over the two."""
    return [rate / ((before + after) / 2) for rate, before, after in zip(rates, baseline_rates, baseline_rates[1:])]


def requests_for(args: argparse.Namespace, streams: int) -> int:
    """The requests a run of `streams` streams serves: --requests-per-stream each, and --min-requests at least."""
    return max(streams * args.requests_per_stream, args.min_requests)


def prompt_sets(tokenizer: Tokenizer, count: int, prompt_tokens: int) -> dict[str, list[list[int]]]:
    return {
        HELD_OUT: load_prompts(tokenizer, count, prompt_tokens),
        SELF_REPEATING: [tokenizer.encode(SELF_REPEATING_TEXT)] * count,
    }


def engine_for(args: argparse.Namespace, name: str, streams: int, prompts: list[list[int]]) -> Engine:
    return Engine(EngineConfig(
        model=args.model, max_num_seqs=streams, device=args.device,
        speculative=SpeculativeConfig.model_validate(METHODS[name]),
        max_model_len=max(EngineConfig.model_fields["max_model_len"].default, max(map(len, prompts)) + args.max_tokens),
    ))


@dataclass
class EnginePass:
    tokens_per_s: float
    mean_step_ms: float
    stats: EngineStats
    outputs: list[list[int]]


def engine_pass(engine: Engine, prompts: list[list[int]], max_tokens: int, temperature: float) -> EnginePass:
    engine.stats = EngineStats()
    started = time.perf_counter()
    with torch.inference_mode():
        outputs = _serve(engine, prompts, max_tokens, temperature)
    seconds = time.perf_counter() - started
    return EnginePass(sum(map(len, outputs)) / seconds, 1e3 * seconds / engine.stats.num_steps, engine.stats, outputs)


@contextmanager
def running_on(cpus: frozenset[int] | None) -> Iterator[None]:
    """This process on `cpus` for the block (None: where it was)."""
    before = os.sched_getaffinity(0)
    pin(cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@contextmanager
def busy_core(cpus: frozenset[int] | None) -> Iterator[None]:
    """A process spinning in pure Python for the block's duration (on `cpus` if given): it takes a core and touches
    no memory."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=lambda: pin(cpus))
    try:
        time.sleep(SPIN_UP_S)
        yield
    finally:
        spinner.kill()
        spinner.wait()


def _serve(engine: Engine, prompts: list[list[int]], max_tokens: int, temperature: float) -> list[list[int]]:
    """Every prompt added at once, stepped until done; each prompt's tokens. A sampled prompt i gets the seed the
    gateway makes of the API seed i (mesh_client.mesh_streams), so engine and mesh draw the same tokens."""
    outputs: list[list[int]] = [[] for _ in prompts]
    for i, ids in enumerate(prompts):
        sampling = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True,
                                  seed=worker_seed(i) if temperature > GREEDY else None)
        engine.add_request(WorkRequest(request_id=f"{i:032x}", prompt_token_ids=ids, sampling=sampling, created=0))
    while engine.has_work():
        for out in engine.step():
            outputs[int(out.seq.request_id, 16)] += out.tokens
    return outputs


def transformers_decode(model, prompts: list[list[int]], max_tokens: int, lookup: int | None
                        ) -> tuple[float, list[list[int]]]:
    """transformers' decode tokens/s over the prompts (each generate(N) minus generate(1)), and its tokens: greedy,
    with or without prompt lookup, they must be the engine's."""
    runs = [hf_decode(model, prompt, max_tokens, lookup) for prompt in prompts]
    return sum(len(tokens) - 1 for tokens, _, _ in runs) / sum(seconds for _, seconds, _ in runs), [r[0] for r in runs]


def run_method(args: argparse.Namespace, name: str, sets: dict[str, list[list[int]]], table: TokenTable,
               hf_model) -> tuple[list[Row], list[str]]:
    """Every run of one method, engine and mesh taking turns (module docstring); its rows and where the mesh's text
    differed from the engine's."""
    rows: list[Row] = []
    mismatches: list[str] = []
    engine_cpus, rest_cpus = args.cpu_plan.engine_cpus[0], args.cpu_plan.rest_cpus
    with tempfile.TemporaryDirectory() as tmp:
        mesh = start_mesh(
            Path(tmp), "--speculative-config", json.dumps(METHODS[name]), "--max-num-seqs", str(max(args.streams)),
            "--device", args.device, "--dtype", EngineConfig.model_fields["dtype"].default, *_cpu_options(args),
            model=args.model,  # the dtype of engine_for's engine, whose greedy tokens the mesh's text must match
        )
        try:
            for prompts_name, all_prompts in sets.items():
                for streams in args.streams:
                    prompts = all_prompts[: requests_for(args, streams)]
                    engine = engine_for(args, name, streams, prompts)

                    def in_process() -> EnginePass:
                        with running_on(engine_cpus):
                            return engine_pass(engine, prompts, args.max_tokens, args.temperature)

                    def mesh_pass() -> tuple[list[Stream], float]:
                        with running_on(rest_cpus):
                            return asyncio.run(
                                mesh_streams(mesh.base_url, mesh.model, prompts, streams, args.max_tokens,
                                             args.temperature))

                    for _ in range(UNTIMED_PASSES):
                        in_process()
                        mesh_pass()
                    # Engine and mesh alternate with nothing else between them; the other passes come after.
                    engine_passes, mesh_passes = [in_process()], []
                    for _ in range(args.rounds):
                        mesh_passes.append(mesh_pass())
                        engine_passes.append(in_process())
                    busy_passes, hf_rates = [], []
                    lookup = LOOKUP_TOKENS if METHODS[name]["method"] == "ngram" else None
                    for _ in range(args.rounds):
                        with busy_core(rest_cpus):
                            busy_passes.append(in_process())
                        if streams == 1 and args.temperature == GREEDY:  # transformers' greedy reference
                            with running_on(engine_cpus):
                                rate, hf_outputs = transformers_decode(hf_model, prompts, args.max_tokens, lookup)
                            hf_rates.append(rate)
                    row = _row(prompts_name, name, streams, engine_passes, mesh_passes, table)
                    row.engine_beside_busy_core_tokens_per_s = float(np.median([p.tokens_per_s for p in busy_passes]))
                    if hf_rates:
                        row.transformers_decode_tokens_per_s = float(np.median(hf_rates))
                        if hf_outputs != row.outputs:
                            mismatches.append(f"transformers {'lookup' if lookup else 'greedy'}, {prompts_name}")
                    mismatches += [f"mesh {name}, {prompts_name}, {streams} streams, request {i}" for i in row.mismatched]
                    print(json.dumps(row.figures()), flush=True)
                    rows.append(row)
        finally:
            mesh.stop()
    return rows, mismatches


def _cpu_options(args: argparse.Namespace) -> list[str]:
    """--engine-cpus and --torch-threads for `specmesh up`, as given here (auto: the mesh's own defaults)."""
    engine_cpus = args.engine_cpus if isinstance(args.engine_cpus, str) else format_cpu_list(args.engine_cpus)
    return ["--engine-cpus", engine_cpus, "--torch-threads", str(args.torch_threads)]


def _row(prompts_name: str, name: str, streams: int, engine_passes: list[EnginePass],
         mesh_passes: list[tuple[list[Stream], float]], table: TokenTable) -> Row:
    """engine_passes: one more than mesh_passes, mesh pass i between engine passes i and i + 1."""
    engine_rates = [p.tokens_per_s for p in engine_passes]
    outputs = engine_passes[0].outputs
    num_tokens = sum(map(len, outputs))
    ends = [token_ends(table, tokens) for tokens in outputs]
    gaps: list[float] = []
    decode_tokens, decode_seconds = 0, 0.0
    mismatched: set[int] = set()
    for streamed, _ in mesh_passes:
        for i, (stream, tokens, (text, token_end)) in enumerate(zip(streamed, outputs, ends)):
            if stream.text != text:
                mismatched.add(i)
            gaps += inter_token_gaps(stream, token_end)
            (first, _), (last, _) = stream.arrivals[0], stream.arrivals[-1]
            if last > first:
                decode_tokens += len(tokens) - first_chunk_tokens(stream, token_end)
                decode_seconds += last - first
    mesh_rates = [num_tokens / seconds for _, seconds in mesh_passes]
    ratios = bracketed_ratios(engine_rates, mesh_rates)
    stats = engine_passes[0].stats
    itl_p50, itl_p99 = (1e3 * float(p) for p in np.percentile(gaps, PERCENTILES))
    return Row(
        prompts=prompts_name, method=name, streams=streams, requests=len(outputs), rounds=len(mesh_passes),
        engine_tokens_per_s=float(np.median(engine_rates)),
        engine_mean_step_ms=float(np.median([p.mean_step_ms for p in engine_passes])),
        mean_acceptance_length=stats.mean_acceptance_length if stats.num_drafts else None,
        mesh_tokens_per_s=float(np.median(mesh_rates)),
        mesh_over_engine=float(np.median(ratios)), mesh_over_engine_rounds=ratios,
        engine_tokens_per_s_passes=engine_rates,
        mesh_itl_p50_ms=itl_p50, mesh_itl_p99_ms=itl_p99,
        mesh_decode_tokens_per_s=decode_tokens / decode_seconds if decode_seconds else None,
        outputs=outputs, mismatched=sorted(mismatched),
    )


def _fmt(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def markdown_table(rows: list[Row]) -> str:
    lines = [
        "| prompts | method | streams | engine tok/s | engine, other core busy | mesh tok/s | mesh / engine "
        "| engine mean step ms "
        "| mesh ITL p50 ms | mesh ITL p99 ms | mesh decode tok/s | transformers decode tok/s | mean acceptance length |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.prompts} | {r.method} | {r.streams} | {_fmt(r.engine_tokens_per_s)} "
            f"| {_fmt(r.engine_beside_busy_core_tokens_per_s)} | {_fmt(r.mesh_tokens_per_s)} "
            f"| {_fmt(r.mesh_over_engine, 2)} | {_fmt(r.engine_mean_step_ms, 2)} | {_fmt(r.mesh_itl_p50_ms, 2)} "
            f"| {_fmt(r.mesh_itl_p99_ms, 2)} | {_fmt(r.mesh_decode_tokens_per_s)} "
            f"| {_fmt(r.transformers_decode_tokens_per_s)} | {_fmt(r.mean_acceptance_length, 2)} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU machine")
    parser.add_argument("--streams", type=int, nargs="+", default=list(STREAMS))
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    cpu_plan.add_arguments(parser)
    parser.add_argument("--requests-per-stream", type=int, default=REQUESTS_PER_STREAM)
    parser.add_argument("--min-requests", type=int, default=MIN_REQUESTS,
                        help="requests a run serves at least, whatever its streams (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="timed passes of engine and of mesh, taking turns")
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS, help="length of the held-out prompts")
    kinds = list(dict.fromkeys(spec["method"] for spec in METHODS.values()))
    parser.add_argument("--methods", nargs="+", choices=kinds, default=["naive", "ngram"],
                        help="the methods to run (default: naive and ngram)")
    parser.add_argument("--prompt-sets", nargs="+", choices=[HELD_OUT, SELF_REPEATING],
                        default=[HELD_OUT, SELF_REPEATING], help="the prompt sets to run (default: both)")
    parser.add_argument(
        "--temperature", type=float, default=GREEDY,
        help="0: greedy, checked against transformers; above: seeded samples, the mesh's checked against the engine's",
    )
    parser.add_argument("--out", type=Path, default=Path("bench-out/speculation"))
    args = parser.parse_args()
    args.cpu_plan = cpu_plan.plan_for(args, 1)
    print(f"CPUs: {args.cpu_plan.describe()}", flush=True)
    if args.cpu_plan.torch_threads:
        torch.set_num_threads(args.cpu_plan.torch_threads)
    tokenizer = Tokenizer(args.model)
    every_set = prompt_sets(tokenizer, max(requests_for(args, s) for s in args.streams), args.prompt_tokens)
    sets = {name: every_set[name] for name in args.prompt_sets}
    methods = [name for name, spec in METHODS.items() if spec["method"] in args.methods]

    table = TokenTable.from_tokenizer(tokenizer)
    rows: list[Row] = []
    mismatches: list[str] = []
    hf_model = shape.transformers_model(args.model, "auto", torch.float32, args.device) if 1 in args.streams else None
    for name in methods:
        method_rows, method_mismatches = run_method(args, name, sets, table, hf_model)
        rows += method_rows
        mismatches += method_mismatches
    first = rows[: len(rows) // len(methods)]  # the first method's rows, in the order every method ran them
    for i, reference in enumerate(first):
        for other in rows[i :: len(first)][1:]:
            # A seeded sample is plain decoding's under point-mass drafts; a model drafter's real q (rejection)
            # decides which draws are accepted, so its samples are its own (equally distributed, not the same).
            model_q = METHODS[other.method]["method"] in MODEL_DRAFTERS
            if other.outputs != reference.outputs and (args.temperature == GREEDY or not model_q):
                mismatches.append(f"engine {other.method}, {other.prompts}, {other.streams} streams")
    rows.sort(key=lambda r: (list(sets).index(r.prompts), r.streams, methods.index(r.method)))
    text = markdown_table(rows)
    print("\n" + text + "\n")
    check = "greedy check" if args.temperature == GREEDY else "seeded check (mesh against engine)"
    print(f"{check}: " + ("OK" if not mismatches else "MISMATCH in " + "; ".join(mismatches)))
    report = {
        "model": str(args.model), "device": args.device, "max_tokens": args.max_tokens, "temperature": args.temperature,
        "prompt_tokens": args.prompt_tokens, "torch_threads": torch.get_num_threads(), "torch_version": torch.__version__,
        "cpu_options": _cpu_options(args), "cpu_plan": args.cpu_plan.describe(),
        "rows": [r.figures() for r in rows], "greedy_mismatches": mismatches,
    }
    save_report(args.out, "speculation", report, text, plot_mesh)
    if mismatches:
        sys.exit(1)


if __name__ == "__main__":
    main()
