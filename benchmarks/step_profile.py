"""What one decode step costs the host: kernel launches (CUDA graph replays counted apart), host<->device copies and
synchronisations per step (CUDA), and torch operator calls per step (every device), by batch size, from
torch.profiler over steady decode steps.

    python -m benchmarks.step_profile [--device cuda] [--shape NAME] [--dtype bfloat16] [--batches 1 8 32]
        [--method naive] [--steps 16] [--out bench-out/profile]

A step whose launches grow with the batch does per-sequence work on the device; the issue's target is a count
independent of the batch and one device-to-host copy per step. Writes profile.json.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

from benchmarks import shape
from shared.config import DEFAULT_MODEL_DIR, EngineConfig, SpeculativeConfig
from shared.schemas import SamplingParams, WorkRequest
from services.worker.engine.engine import Engine

PROMPT_TOKENS = 64
WARMUP_STEPS = 4
PROFILED_STEPS = 16
LAUNCH_EVENTS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
# A replayed CUDA graph is one launch from the host however many kernels it holds, so it is counted apart.
GRAPH_LAUNCH_EVENTS = ("cudaGraphLaunch",)
COPY_EVENTS = ("cudaMemcpyAsync", "cudaMemcpy")
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
DEVICE_TO_HOST = "Memcpy DtoH"


def _engine(args: argparse.Namespace, batch: int) -> Engine:
    spec = SpeculativeConfig.model_validate({"method": args.method} | (
        {} if args.method == "naive" else {"num_speculative_tokens": args.num_speculative_tokens}))
    model_dir, load_format = shape.model_source(args)
    engine = Engine(EngineConfig(model=model_dir, device=args.device, max_num_seqs=batch, speculative=spec,
                                 dtype=args.dtype, load_format=load_format))
    total = WARMUP_STEPS + args.steps + 8
    for i in range(batch):
        prompt = [(i * 131 + j * 7) % 4000 + 5 for j in range(PROMPT_TOKENS)]
        engine.add_request(WorkRequest(
            request_id=f"{i:032x}", prompt_token_ids=prompt, created=0,
            sampling=SamplingParams(temperature=args.temperature, max_tokens=total * 4, ignore_eos=True, seed=i),
        ))
    return engine


def profile_batch(args: argparse.Namespace, batch: int) -> dict:
    engine = _engine(args, batch)
    for _ in range(WARMUP_STEPS):  # prefill and the first decode steps
        engine.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    started = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            engine.step()
    seconds = time.perf_counter() - started
    names = Counter(e.name for e in prof.events())
    per_step = {
        "kernel_launches": sum(names[n] for n in LAUNCH_EVENTS),
        "graph_launches": sum(names[n] for n in GRAPH_LAUNCH_EVENTS),
        "copy_calls": sum(names[n] for n in COPY_EVENTS),
        "device_to_host_copies": sum(c for n, c in names.items() if n.startswith(DEVICE_TO_HOST)),
        "synchronisations": sum(names[n] for n in SYNC_EVENTS),
        "torch_ops": sum(c for n, c in names.items() if n.startswith("aten::")),
    }
    return {
        "batch": batch,
        "ms_per_step_profiled": 1e3 * seconds / args.steps,
        **{k: v / args.steps for k, v in per_step.items()},
        "top_ops": [(n, c / args.steps) for n, c in names.most_common() if n.startswith("aten::")][:12],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    shape.add_arguments(parser)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--method", default="naive")
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--steps", type=int, default=PROFILED_STEPS, help="decode steps profiled per batch")
    parser.add_argument("--out", type=Path, default=Path("bench-out/profile"))
    args = parser.parse_args()
    rows = [profile_batch(args, b) for b in args.batches]
    print("| batch | ms/step (profiled) | kernel launches | graph launches | copy calls | DtoH copies | syncs "
          "| torch ops |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['batch']} | {r['ms_per_step_profiled']:.2f} | {r['kernel_launches']:.0f} "
              f"| {r['graph_launches']:.1f} | {r['copy_calls']:.1f} "
              f"| {r['device_to_host_copies']:.1f} | {r['synchronisations']:.1f} | {r['torch_ops']:.0f} |")
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"model": str(shape.model_source(args)[0]), "dtype": args.dtype, "device": args.device,
              "method": args.method, "temperature": args.temperature, "rows": rows}
    (args.out / "profile.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
