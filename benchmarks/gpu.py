"""Plain decoding per real-size shape, against transformers `generate` and the weight-read floor (issue 9):

    python -m benchmarks.gpu --shape qwen2.5-0.5b [--shape qwen2.5-7b ...] --device cuda --dtype bfloat16
        [--shape-dir DIR] [--batches 1 8 32 64] [--contexts 64 2048] [--steps 32] [--skip transformers eager]
        [--out bench-out/gpu]

For each shape (random weights from its config.json, benchmarks/shape.py; --shape-dir names a directory holding
a config.json anywhere), at every batch and context (each sequence its own prompt of that many random ids):

- specmesh naive, greedy: ms per decode step and tokens/s over --steps steps, timed after the prefill and
  --warmup-steps more, the device synchronised at both ends. On CUDA its decode passes replay CUDA graphs.
- transformers `generate`, greedy, same weights, batch and prompts: its decode time is generate(N tokens) minus
  generate(1 token), after an untimed call. With --transformers-cache static (the default) it decodes over a
  static cache, which generate compiles itself on a GPU (torch.compile, mode reduce-overhead, i.e. CUDA graphs;
  compiled afresh for each batch and context) and runs eagerly on the CPU; `dynamic` is its eager default.
- at batch 1: specmesh with --enforce-eager (what the graphs buy: eager ms / graph ms), and the weight-read floor
  (benchmarks/floor.py) at the copy bandwidth measured at the start of this run.

Figures are medians of --repeats runs. An engine and transformers' model are never loaded together, so an 8B
shape fits beside its caches. specmesh's tokens are compared with transformers' (share of sequences equal):
reported, not enforced, since with random bf16 weights near-ties may break either way. --skip leaves out the
transformers rows (and with them the token comparison) or the eager ones, for a run on a time budget
(benchmarks/gpu_check.py): generate compiles afresh for every batch and context. Writes gpu.json, gpu.png and
table.md to --out. On the CPU, with a tiny config, it is the suite's smoke test (tests/test_gpu_benchmark.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
import uuid
from importlib import metadata
from pathlib import Path

import torch

from benchmarks import shape
from benchmarks.floor import copy_bandwidth, weight_floor
from benchmarks.plot import plot_gpu
from shared.config import EngineConfig
from shared.schemas import SamplingParams, WorkRequest
from services.worker.engine.engine import Engine

BATCHES = (1, 8, 32, 64)
CONTEXTS = (64, 2048)
DEFAULT_WARMUP_STEPS = 8
DEFAULT_STEPS = 32
DEFAULT_REPEATS = 3
DEFAULT_COPY_MIB = 1024  # far past any GPU's L2, so the copy runs at memory speed
MIB = 1 << 20
MS_PER_S = 1e3
PAD_TOKEN_ID = 0  # transformers asks for one; no prompt is padded
GRAPHS, EAGER, TRANSFORMERS = "specmesh naive", "specmesh naive, eager", "transformers generate"
TRANSFORMERS_CACHES = ("static", "dynamic")
SKIPPABLE = ("transformers", "eager")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release(device: torch.device) -> None:
    """Gives the GPU back what the last engine or model held (reference cycles included) before the next loads."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def prompts(vocab_size: int, batch: int, context: int) -> list[list[int]]:
    return [shape.random_prompt(vocab_size, context, seed=i) for i in range(batch)]


def engine_decode(engine: Engine, rows: list[list[int]], warmup: int, steps: int) -> tuple[list[list[int]], float]:
    """(every sequence's tokens, seconds of the `steps` timed decode steps), all sequences stepping together."""
    sampling = SamplingParams(temperature=0.0, max_tokens=1 + warmup + steps, ignore_eos=True)
    seqs = [s for row in rows for s in engine.add_request(
        WorkRequest(request_id=uuid.uuid4().hex, prompt_token_ids=row, sampling=sampling, created=0))]
    device = engine.runner.device
    for _ in range(1 + warmup):  # the prefill samples every first token, then warm-up steps
        engine.step()
    _sync(device)
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync(device)
    seconds = time.perf_counter() - started
    if engine.has_work() or any(len(s.output_ids) != sampling.max_tokens for s in seqs):
        raise RuntimeError(f"{len(rows)} sequences did not decode together: a timed step was not a full batch")
    return [s.output_ids for s in seqs], seconds


def engine_rows(
    model_dir: Path, args: argparse.Namespace, batches: list[int], eager: bool, bandwidth: float
) -> tuple[list[dict], dict]:
    """specmesh's rows at these batches and every context, and the shape's weight floor at `bandwidth`."""
    engine = Engine(EngineConfig(
        model=model_dir, device=args.device, dtype=args.dtype, load_format="dummy", max_num_seqs=max(batches),
        max_model_len=max(args.contexts) + 1 + args.warmup_steps + args.steps, enforce_eager=eager,
    ))
    vocab_size, graphs = engine.vocab_size, engine.runner.graphs is not None
    floor = weight_floor(engine.runner.model, bandwidth).as_dict()
    rows = []
    with torch.inference_mode():
        engine_decode(engine, prompts(vocab_size, 1, min(args.contexts)), 1, 1)  # first-use compilation
        for context in args.contexts:
            for batch in batches:
                runs = [engine_decode(engine, prompts(vocab_size, batch, context), args.warmup_steps, args.steps)
                        for _ in range(args.repeats)]
                seconds = statistics.median(s for _, s in runs)
                rows.append({"system": EAGER if eager else GRAPHS, "batch": batch, "context": context,
                             "cuda_graphs": graphs, "ms_per_step": MS_PER_S * seconds / args.steps,
                             "tokens_per_s": batch * args.steps / seconds, "tokens": runs[0][0]})
    del engine
    _release(torch.device(args.device))
    return rows, floor


def hf_generate(model, ids: torch.Tensor, new_tokens: int, args: argparse.Namespace) -> tuple[list[list[int]], float]:
    """(tokens of every row, seconds) of one greedy generate of new_tokens; the static cache is sized for the
    longest call, so every call of a case reuses one compiled graph."""
    import transformers  # here: a run with --skip transformers need not load it

    static = args.transformers_cache == "static"
    config = transformers.GenerationConfig(
        do_sample=False, max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=PAD_TOKEN_ID,
        cache_implementation="static" if static else None,
        max_cache_len=ids.shape[1] + 1 + args.warmup_steps + args.steps if static else None,
        # Stated rather than left to generate's default, so the mode the report names is the one that ran.
        compile_config=transformers.CompileConfig() if _compiled(args) else None,
    )
    _sync(ids.device)
    started = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    _sync(ids.device)
    return out[:, ids.shape[1]:].tolist(), time.perf_counter() - started


def _compiled(args: argparse.Namespace) -> bool:
    """generate compiles its decode forward when the cache is static and the device a GPU."""
    return args.transformers_cache == "static" and torch.device(args.device).type == "cuda"


def transformers_mode(args: argparse.Namespace) -> str:
    if "transformers" in args.skip:
        return "not run (--skip transformers)"
    if args.transformers_cache == "dynamic":
        return "dynamic cache, eager"
    if _compiled(args):
        import transformers

        mode = transformers.CompileConfig().mode
        return f"static cache, compiled by generate (torch.compile, mode {mode}), afresh for each batch and context"
    return "static cache, eager (generate compiles only on accelerators)"


def transformers_rows(model_dir: Path, args: argparse.Namespace) -> list[dict]:
    model = shape.transformers_model(model_dir, "dummy", shape.DTYPES[args.dtype], args.device)
    compiled = _compiled(args)
    new_tokens = 1 + args.warmup_steps + args.steps
    rows = []
    for context in args.contexts:
        for batch in args.batches:
            ids = torch.tensor(prompts(model.config.vocab_size, batch, context), device=model.device)
            if compiled:
                torch._dynamo.reset()  # each case compiled for its own shapes, as a server of that shape would
            tokens, _ = hf_generate(model, ids, new_tokens, args)  # untimed: compiles, and fills the cache
            decode = []
            for _ in range(args.repeats):
                whole, first = hf_generate(model, ids, new_tokens, args)[1], hf_generate(model, ids, 1, args)[1]
                decode.append(whole - first)
            seconds = statistics.median(decode)
            rows.append({"system": TRANSFORMERS, "batch": batch, "context": context, "cuda_graphs": compiled,
                         "ms_per_step": MS_PER_S * seconds / (new_tokens - 1),
                         "tokens_per_s": batch * (new_tokens - 1) / seconds, "tokens": tokens})
    del model
    _release(torch.device(args.device))
    return rows


def measure_shape(name: str, model_dir: Path, args: argparse.Namespace, bandwidth: float) -> tuple[dict, list[dict]]:
    """The shape's summary (floor, graphs' speed-up) and its rows, tokens compared with transformers'."""
    rows, floor = engine_rows(model_dir, args, args.batches, eager=False, bandwidth=bandwidth)
    eager = [] if "eager" in args.skip else engine_rows(model_dir, args, [1], eager=True, bandwidth=bandwidth)[0]
    reference = [] if "transformers" in args.skip else transformers_rows(model_dir, args)
    expected = {(r["batch"], r["context"]): r.pop("tokens") for r in reference}
    for row in rows + eager:
        tokens = row.pop("tokens")
        want = expected.get((row["batch"], row["context"]))
        row["same_tokens"] = None if want is None else sum(a == b for a, b in zip(tokens, want)) / len(want)
    graph_ms = {r["context"]: r["ms_per_step"] for r in rows if r["batch"] == 1}
    speedup = {str(r["context"]): r["ms_per_step"] / graph_ms[r["context"]] for r in eager}
    summary = {"shape": name, "model_dir": str(model_dir), "floor": floor, "graphs_speedup_batch1": speedup}
    return summary, [{"shape": name} | r for r in rows + eager + reference]


def table(report: dict) -> str:
    lines = ["| shape | context | batch | system | ms/step | tok/s | vs transformers | same tokens |",
             "|---|---:|---:|---|---:|---:|---:|---:|"]
    rows = report["rows"]
    reference = {(r["shape"], r["batch"], r["context"]): r for r in rows if r["system"] == TRANSFORMERS}
    for r in sorted(rows, key=lambda r: (r["shape"], r["context"], r["batch"], r["system"] != GRAPHS)):
        theirs = reference.get((r["shape"], r["batch"], r["context"]))
        ratio = "–" if theirs is None else f"{r['tokens_per_s'] / theirs['tokens_per_s']:.2f}x"
        same = "–" if r.get("same_tokens") is None else f"{r['same_tokens']:.0%}"
        lines.append(f"| {r['shape']} | {r['context']} | {r['batch']} | {r['system']} | {r['ms_per_step']:.2f} | "
                     f"{r['tokens_per_s']:,.0f} | {ratio} | {same} |")
    lines += ["", "| shape | weights read/step | floor ms/step | floor tok/s (batch 1) | specmesh batch 1 / floor | "
              "graphs speed-up (batch 1) |", "|---|---:|---:|---:|---:|---:|"]
    for s in report["shapes"]:
        floor = s["floor"]
        shares = ", ".join(f"{r['tokens_per_s'] / floor['tokens_per_s_batch1']:.2f} (ctx {r['context']})"
                           for r in rows if r["shape"] == s["shape"] and r["system"] == GRAPHS and r["batch"] == 1)
        speedups = ", ".join(f"{v:.2f}x (ctx {k})" for k, v in s["graphs_speedup_batch1"].items())
        lines.append(f"| {s['shape']} | {floor['read_bytes_per_step'] / 1e9:.3f} GB | {floor['ms_per_step']:.3f} | "
                     f"{floor['tokens_per_s_batch1']:,.0f} | {shares} | {speedups} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", action="append", default=[], choices=shape.shape_names())
    parser.add_argument("--shape-dir", action="append", default=[], type=Path,
                        help="a directory with a config.json, measured as a shape named after the directory")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=list(shape.DTYPES))
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    parser.add_argument("--warmup-steps", type=int, default=DEFAULT_WARMUP_STEPS)
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS)
    parser.add_argument("--copy-mib", type=int, default=DEFAULT_COPY_MIB, help="size of the bandwidth probe's copy")
    parser.add_argument("--transformers-cache", choices=TRANSFORMERS_CACHES, default="static")
    parser.add_argument("--skip", nargs="+", choices=SKIPPABLE, default=[],
                        help="leave out transformers' rows (and the token comparison) or specmesh's eager ones")
    parser.add_argument("--out", type=Path, default=Path("bench-out/gpu"))
    args = parser.parse_args(argv)
    if not args.shape and not args.shape_dir:
        parser.error("name at least one --shape or --shape-dir")
    if min(args.batches + args.contexts + [args.steps, args.repeats, args.copy_mib]) < 1 or args.warmup_steps < 0:
        parser.error("--batches, --contexts, --steps, --repeats and --copy-mib take positive numbers, "
                     "--warmup-steps a non-negative one")
    return args


def measure(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    bandwidth = copy_bandwidth(device, args.copy_mib * MIB)
    _release(device)
    named = [(n, shape.shape_dir(n)) for n in args.shape] + [(d.name, d) for d in args.shape_dir]
    shapes, rows = [], []
    for name, model_dir in named:
        summary, shape_rows = measure_shape(name, model_dir, args, bandwidth)
        shapes.append(summary)
        rows += shape_rows
    return {
        "device": args.device, "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": args.dtype, "batches": args.batches, "contexts": args.contexts, "warmup_steps": args.warmup_steps,
        "timed_steps": args.steps, "repeats": args.repeats, "copy_bytes": args.copy_mib * MIB,
        "copy_bandwidth_gb_s": bandwidth / 1e9, "transformers_mode": transformers_mode(args),
        "torch_version": torch.__version__, "transformers_version": metadata.version("transformers"),
        "shapes": shapes, "rows": rows,
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    report = measure(args)
    text = table(report)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "table.md").write_text(text + "\n")
    plot_gpu(report, args.out / "gpu.png")
    print(f"wrote {args.out / 'gpu.json'}, {args.out / 'gpu.png'}, {args.out / 'table.md'}")
    return report


if __name__ == "__main__":
    main()
