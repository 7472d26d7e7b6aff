"""Engine step time split over two tensor-parallel ranks against the whole model in one process, on the CPU.

    python -m benchmarks.tensor_parallel [--batch 1 8] [--prompt-len 256] [--max-tokens 64] [--repeats 3]

Both engines get the same CPUs: the whole model TP=1 with one torch thread per CPU of this process, TP=2 with the
CPUs split between its ranks (services/worker/tensor_parallel/placement.py). Per batch size, greedy naive decoding
of `batch` random-id prompts: the prefill step's time and the median decode step time (each figure the median
of --repeats runs, the engines' runs interleaved). Every TP=2 run's tokens must equal TP=1's (exit status 1
otherwise). A figure to report, not a target: on a small CPU two ranks split a step's arithmetic but add two
all-reduces per layer and a message per pass, which a model this small does not earn back.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid

import torch

from shared.config import DEFAULT_MODEL_DIR, EngineConfig, SpeculativeConfig
from shared.schemas import SamplingParams, WorkRequest
from services.worker.engine.engine import Engine

TP_SIZES = (1, 2)
DEFAULT_BATCHES = (1, 8)
DEFAULT_PROMPT_LEN = 256
DEFAULT_MAX_TOKENS = 64
DEFAULT_REPEATS = 3
MAX_MODEL_LEN = 1024
SEED = 0
MS = 1e3


def _prompts(batch: int, prompt_len: int, vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(SEED)
    return torch.randint(1, vocab_size, (batch, prompt_len), generator=generator).tolist()


def _run(engine: Engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, float, list[list[int]]]:
    """(prefill step seconds, median decode step seconds, tokens per prompt) of one batch run to the end."""
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    seqs = [
        seq for prompt in prompts for seq in engine.add_request(
            WorkRequest(request_id=uuid.uuid4().hex, prompt_token_ids=prompt, sampling=sampling, created=0)
        )
    ]
    times = []
    while engine.has_work():
        began = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - began)
    return times[0], statistics.median(times[1:]), [list(s.output_ids) for s in seqs]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=list(DEFAULT_BATCHES))
    parser.add_argument("--prompt-len", type=int, default=DEFAULT_PROMPT_LEN)
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS)
    args = parser.parse_args()
    cpus = len(os.sched_getaffinity(0))
    torch.set_num_threads(cpus)
    engines = {
        tp: Engine(EngineConfig(
            model=DEFAULT_MODEL_DIR, max_num_seqs=max(args.batch), max_model_len=MAX_MODEL_LEN,
            speculative=SpeculativeConfig(method="naive"), tensor_parallel_size=tp, enable_prefix_caching=False,
        ))
        for tp in TP_SIZES
    }
    print(f"demo model, {cpus} CPUs, prompt {args.prompt_len} tokens, {args.max_tokens} greedy tokens, "
          f"median of {args.repeats} runs")
    print(f"{'batch':>5} {'TP':>3} {'prefill ms':>11} {'decode ms/step':>15} {'decode tok/s':>13}")
    status = 0
    for batch in args.batch:
        prompts = _prompts(batch, args.prompt_len, engines[1].vocab_size)
        runs: dict[int, list[tuple[float, float, list[list[int]]]]] = {tp: [] for tp in TP_SIZES}
        for _ in range(args.repeats):
            for tp in TP_SIZES:
                runs[tp].append(_run(engines[tp], prompts, args.max_tokens))
        for tp in TP_SIZES:
            prefill = statistics.median(r[0] for r in runs[tp])
            decode = statistics.median(r[1] for r in runs[tp])
            print(f"{batch:>5} {tp:>3} {prefill * MS:>11.1f} {decode * MS:>15.2f} {batch / decode:>13.0f}")
            if any(r[2] != runs[TP_SIZES[0]][0][2] for r in runs[tp]):
                print(f"batch {batch}: TP={tp} tokens differ from TP=1's", file=sys.stderr)
                status = 1
    for tp, engine in engines.items():
        if tp > 1:
            engine.runner.close()
    return status


if __name__ == "__main__":
    sys.exit(main())
