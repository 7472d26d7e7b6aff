"""Prefix caching, measured: time to first token of a request whose 1,500-token prompt is cached against the same
request cold, through the whole mesh (`specmesh up` on its defaults but the speculative method), on code the demo
model never saw; and what a cached prefix costs each later decode step.

    python -m benchmarks.prefix_cache [--methods naive ngram mtp] [--rounds 4] [--prompt-tokens 1500]
        [--max-tokens 64] [--step-seqs 8] [--out bench-out/prefix-cache]

Per method, one mesh; per round, a fresh prompt (the opening of one of aiohttp's files, as benchmarks/heldout.py
takes them) and a fresh `cache_salt`, so that no round finds what another left: the request is sent cold, then
again. Each is one greedy streamed completion with logprobs and its speculation summary: the figures are the time
from sending to the first chunk, `usage.prompt_tokens_details.cached_tokens`, and the acceptance length; the hot
request's text must equal the cold one's and its logprobs must agree within LOGPROB_TOLERANCE (exit status 1
otherwise). Median over rounds.

The step cost, in this process on the engine: `--step-seqs` sequences decoding at a 1,500-token context, each from
a cached prefix, with their tables one ascending run (the CPU's default: a cached block outside the slot's home
region is copied there) against the same prefix shared in place (the tables no longer one run, as the blocks of a
prefix shared between running sequences are on a GPU). Median ms per decode step over alternating runs.

Writes prefix-cache.json, prefix-cache.png and table.md to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp
import orjson
import torch

from benchmarks.heldout import PACKAGE, package_prompts
from benchmarks.mesh_client import HTTP_TIMEOUT_S
from benchmarks.plot import plot_prefix_cache, save_report
from services.mesh_process import start_mesh
from shared.config import DEFAULT_MODEL_DIR, EngineConfig, SpeculativeConfig
from shared.schemas import SamplingParams, WorkRequest
from shared.tokenizer import Tokenizer

# Fixed drafts per step: adaptive speculation (ngram's default) picks them from step timings, which would make the
# acceptance of a cold and a cached run differ for reasons that have nothing to do with the cache.
METHODS = {
    "naive": {"method": "naive"},
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False},
    "mtp": {"method": "mtp", "num_speculative_tokens": 3, "num_model_steps": 3},
}
LOGPROB_TOLERANCE = 1e-4  # cached blocks were computed in a pass of another shape: float32 summation order
STEP_RUNS = 4  # alternating engine runs per layout
STEPS_PER_RUN = 48


async def completion(session: aiohttp.ClientSession, url: str, body: dict) -> dict:
    """One streamed completion: seconds to its first chunk, text, logprobs and usage."""
    sent = time.perf_counter()
    first = None
    text, logprobs, usage = [], [], None
    async with session.post(url, json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            event = orjson.loads(line[len(b"data: "):])
            if "error" in event:
                raise RuntimeError(f"the mesh failed a request: {event['error']}")
            if event.get("usage"):
                usage = event["usage"]
            for choice in event["choices"]:
                first = first or time.perf_counter()
                text.append(choice["text"])
                logprobs += choice["logprobs"]["token_logprobs"]
    return {"ttft_s": first - sent, "text": "".join(text), "logprobs": logprobs, "usage": usage}


async def cold_and_hot(base_url: str, model: str, prompts: list[list[int]], max_tokens: int) -> list[tuple[dict, dict]]:
    timeout = aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S)
    pairs = []
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for ids in prompts:
            body = {
                "model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True, "logprobs": 1, "stream_options": {"include_usage": True},
                "speculative": {"return_stats": True}, "cache_salt": uuid.uuid4().hex,
            }
            url = f"{base_url}/completions"
            pairs.append((await completion(session, url, body), await completion(session, url, body)))
    return pairs


def acceptance_length(usage: dict) -> float | None:
    speculative = usage.get("speculative")
    return speculative["mean_acceptance_length"] if speculative and speculative["num_spec_steps"] else None


def method_row(name: str, pairs: list[tuple[dict, dict]]) -> dict:
    for cold, hot in pairs:
        if hot["text"] != cold["text"]:
            raise SystemExit(f"{name}: the cached request's text differs from the cold one's")
        worst = max(abs(a - b) for a, b in zip(cold["logprobs"], hot["logprobs"]))
        if worst > LOGPROB_TOLERANCE:
            raise SystemExit(f"{name}: logprobs differ by {worst:.2e} on a hit")
    median = statistics.median
    cold_ttft, hot_ttft = median(c["ttft_s"] for c, _ in pairs), median(h["ttft_s"] for _, h in pairs)
    lengths = [(acceptance_length(c["usage"]), acceptance_length(h["usage"])) for c, h in pairs]
    drafted = [pair for pair in lengths if pair[0] is not None]
    return {
        "method": name,
        "cold_ttft_ms": 1e3 * cold_ttft,
        "hot_ttft_ms": 1e3 * hot_ttft,
        "ttft_ratio": hot_ttft / cold_ttft,
        "cold_cached_tokens": median(c["usage"]["prompt_tokens_details"]["cached_tokens"] for c, _ in pairs),
        "hot_cached_tokens": median(h["usage"]["prompt_tokens_details"]["cached_tokens"] for _, h in pairs),
        "cold_acceptance_length": median(c for c, _ in drafted) if drafted else None,
        "hot_acceptance_length": median(h for _, h in drafted) if drafted else None,
        "max_logprob_difference": max(
            max(abs(a - b) for a, b in zip(c["logprobs"], h["logprobs"])) for c, h in pairs
        ),
    }


def step_cost(prompt: list[int], num_seqs: int) -> dict:
    """ms per decode step of num_seqs sequences from one cached prefix: tables one run (copied) vs shared in place."""
    from services.worker.engine.engine import Engine  # the engine is only needed here

    def run(copy_hits: bool) -> float:
        config = EngineConfig(
            model=DEFAULT_MODEL_DIR, max_num_seqs=num_seqs, max_model_len=len(prompt) + STEPS_PER_RUN + 8,
            speculative=SpeculativeConfig(method="naive"),
        )
        engine = Engine(config)
        engine.scheduler.blocks.copy_hits = copy_hits
        request = lambda: WorkRequest(  # noqa: E731
            request_id=uuid.uuid4().hex, prompt_token_ids=prompt, created=0.0,
            sampling=SamplingParams(max_tokens=STEPS_PER_RUN, temperature=0.0, ignore_eos=True),
        )
        engine.add_request(request())
        while engine.has_work():
            engine.step()
        for _ in range(num_seqs):
            engine.add_request(request())
        engine.step()  # every one admitted from the cache and prefilled
        times = []
        while engine.has_work():
            started = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - started)
        return statistics.median(times[2:-2]) * 1e3

    one_run, shared = [], []
    with torch.inference_mode():
        for _ in range(STEP_RUNS):
            one_run.append(run(copy_hits=True))
            shared.append(run(copy_hits=False))
    return {
        "num_seqs": num_seqs, "context": len(prompt),
        "one_run_ms": statistics.median(one_run), "shared_in_place_ms": statistics.median(shared),
        "ratio": statistics.median(shared) / statistics.median(one_run),
    }


def markdown_table(report: dict) -> str:
    lines = [
        "| method | cold TTFT ms | cached TTFT ms | ratio | cached tokens (cold / hot) "
        "| acceptance length (cold / hot) |",
        "|---|---|---|---|---|---|",
    ]
    for row in report["methods"]:
        accept = (
            f"{row['cold_acceptance_length']:.3f} / {row['hot_acceptance_length']:.3f}"
            if row["cold_acceptance_length"] is not None else "-"
        )
        lines.append(
            f"| {row['method']} | {row['cold_ttft_ms']:.0f} | {row['hot_ttft_ms']:.0f} | {row['ttft_ratio']:.3f} | "
            f"{row['cold_cached_tokens']:.0f} / {row['hot_cached_tokens']:.0f} | {accept} |"
        )
    step = report.get("step_cost")
    if step:
        lines.append("")
        lines.append(
            f"Decode step, {step['num_seqs']} sequences at a {step['context']}-token cached prefix: tables one run "
            f"{step['one_run_ms']:.2f} ms, prefix shared in place {step['shared_in_place_ms']:.2f} ms "
            f"({step['ratio']:.2f}x)."
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--step-seqs", type=int, default=8, help="0: skip the step-cost measurement")
    parser.add_argument("--out", type=Path, default=Path("bench-out/prefix-cache"))
    args = parser.parse_args()

    tokenizer = Tokenizer(DEFAULT_MODEL_DIR)
    prompts = package_prompts(tokenizer, PACKAGE, args.rounds * len(args.methods) + 1, args.prompt_tokens)
    rows = []
    for index, name in enumerate(args.methods):
        config = json.dumps(METHODS[name])
        with tempfile.TemporaryDirectory() as tmp:
            mesh = start_mesh(Path(tmp), "--speculative-config", config)
            try:
                round_prompts = prompts[index * args.rounds : (index + 1) * args.rounds]
                pairs = asyncio.run(cold_and_hot(mesh.base_url, mesh.model, round_prompts, args.max_tokens))
            finally:
                mesh.stop()
        rows.append(method_row(name, pairs))
        print(markdown_table({"methods": rows[-1:]}).splitlines()[-1], flush=True)
    report = {"package": PACKAGE, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
              "rounds": args.rounds, "methods": rows}
    if args.step_seqs:
        report["step_cost"] = step_cost(prompts[-1], args.step_seqs)
    table = markdown_table(report)
    print(table)
    save_report(args.out, "prefix-cache", report, table, plot_prefix_cache)


if __name__ == "__main__":
    sys.exit(main())
