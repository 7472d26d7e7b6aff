"""Prefill/decode disaggregation, measured through the whole mesh on this machine's defaults.

    python -m benchmarks.disaggregation [--decode-streams 8] [--long-prompt-tokens 1900] [--arrivals 10]
        [--interval 1.0] [--out bench-out/disaggregation]

1. The handoff's cost, on `specmesh up --prefill-workers 1 --decode-workers 1`: single requests with prompts of 1k
   and 2k tokens (aiohttp's own source, text the demo model never saw); KV bytes sent per prompt token and the
   handoff's time (export to a decode worker holding the request: placement, transfer, queueing) per 1k prompt
   tokens, from the prefill worker's metrics.
2. Long prompts arriving while others decode: --decode-streams streams of --decode-tokens tokens each start first;
   once they all stream, a --long-prompt-tokens prompt arrives every --interval seconds, --arrivals times (16 tokens
   each). Inter-token latency (ITL) of the decoding streams over that window, per token (a chunk's gap to the chunk
   before, divided by the tokens it brought), and the long prompts' time to first token (TTFT), p50 and p99: PD
   (one prefill and one decode worker) against two colocated workers (`--workers 2`), both otherwise on defaults.

Writes disaggregation.json, its PNG and table.md to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp
import orjson

from benchmarks.heldout import PACKAGE, package_prompts
from benchmarks.mesh_client import HTTP_TIMEOUT_S, sse_events
from benchmarks.plot import drawing, grouped_bars, plt, save_figure, save_report
from services.mesh_process import start_mesh
from shared.config import DEFAULT_MODEL_DIR
from shared.tokenizer import Tokenizer

LAYOUTS = {"PD (1 prefill + 1 decode)": ("--prefill-workers", "1", "--decode-workers", "1"),
           "colocated (2 workers)": ("--workers", "2")}
HANDOFF_PROMPTS = (1024, 2048 - 16)
LONG_PROMPT_OUTPUT = 16


async def timed_stream(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[float, list[tuple[float, int]]]:
    """(when it was sent, [(when each chunk with tokens arrived, tokens it brought)])."""
    sent = time.perf_counter()
    chunks = []
    async with session.post(url, json={**body, "stream": True, "logprobs": 0}) as response:
        async for at, event in sse_events(response):
            tokens = len((event["choices"][0].get("logprobs") or {}).get("tokens") or [])
            if tokens:
                chunks.append((at, tokens))
    return sent, chunks


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def handoff_cost(mesh, prompts: dict[int, list[int]]) -> dict:
    deadline = time.monotonic() + 10
    while "worker-0" not in mesh.metrics_urls:  # printed just after "specmesh is up"
        if time.monotonic() > deadline:
            raise SystemExit("specmesh up printed no metrics address for worker-0")
        time.sleep(0.1)
    prefill_metrics = mesh.metrics_urls["worker-0"]
    url = f"{mesh.base_url}/completions"
    rows = {}
    for tokens, ids in prompts.items():
        bytes_before = _metric(prefill_metrics, "specmesh_worker_handoff_bytes_total")
        seconds_before = _metric(prefill_metrics, "specmesh_worker_handoff_duration_seconds_sum")
        body = {"model": mesh.model, "prompt": ids, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
        with urllib.request.urlopen(urllib.request.Request(
            url, data=orjson.dumps(body), headers={"content-type": "application/json"}
        ), timeout=HTTP_TIMEOUT_S) as response:
            response.read()
        time.sleep(0.5)  # the handoff's metrics, observed after the decode worker has the request
        sent = _metric(prefill_metrics, "specmesh_worker_handoff_bytes_total") - bytes_before
        seconds = _metric(prefill_metrics, "specmesh_worker_handoff_duration_seconds_sum") - seconds_before
        rows[tokens] = {"bytes_per_token": sent / tokens, "seconds_per_1k_tokens": seconds / tokens * 1000}
        print(f"handoff of a {tokens}-token prompt: {sent / tokens:.0f} B/token, {seconds * 1000:.1f} ms "
              f"({seconds / tokens * 1e6:.1f} ms per 1k tokens)", flush=True)
    return rows


async def mixed_load(base_url: str, model: str, decode_prompts: list[list[int]], long_prompts: list[list[int]],
                     decode_tokens: int, interval: float) -> dict:
    url = f"{base_url}/completions"
    timeout = aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        decoding = [
            asyncio.create_task(timed_stream(session, url, {
                "model": model, "prompt": ids, "max_tokens": decode_tokens, "temperature": 0, "ignore_eos": True,
            }))
            for ids in decode_prompts
        ]
        await asyncio.sleep(2.0)  # every decoding stream is past its prefill
        window_start = time.perf_counter()
        arrivals = []
        for ids in long_prompts:
            arrivals.append(asyncio.create_task(timed_stream(session, url, {
                "model": model, "prompt": ids, "max_tokens": LONG_PROMPT_OUTPUT, "temperature": 0,
                "ignore_eos": True,
            })))
            await asyncio.sleep(interval)
        long_results = await asyncio.gather(*arrivals)
        window_end = time.perf_counter()
        decode_results = await asyncio.gather(*decoding)
    itl = []
    for _, chunks in decode_results:
        for (before, _), (at, tokens) in zip(chunks, chunks[1:]):
            if window_start <= at <= window_end:
                itl += [(at - before) / tokens] * tokens
    if not itl:
        raise SystemExit("the decoding streams ended before the long prompts arrived: raise --decode-tokens")
    ttft = [chunks[0][0] - sent for sent, chunks in long_results]
    return {
        "itl_p50_ms": percentile(itl, 0.5) * 1000, "itl_p99_ms": percentile(itl, 0.99) * 1000,
        "ttft_p50_ms": percentile(ttft, 0.5) * 1000, "ttft_p99_ms": percentile(ttft, 0.99) * 1000,
        "itl_tokens": len(itl),
    }


def markdown_table(report: dict) -> str:
    lines = ["| KV handoff | bytes per prompt token | handoff ms per 1k prompt tokens |", "|---|---|---|"]
    for tokens, row in report["handoff"].items():
        ms = row["seconds_per_1k_tokens"] * 1000
        lines.append(f"| {tokens}-token prompt | {row['bytes_per_token']:.0f} | {ms:.1f} |")
    lines += ["", "| layout | decode ITL p50 (ms) | decode ITL p99 (ms) | long-prompt TTFT p50 (ms) | TTFT p99 (ms) |",
              "|---|---|---|---|---|"]
    for layout, row in report["load"].items():
        lines.append(f"| {layout} | {row['itl_p50_ms']:.1f} | {row['itl_p99_ms']:.1f} | {row['ttft_p50_ms']:.0f} | "
                     f"{row['ttft_p99_ms']:.0f} |")
    pd, colocated = (report["load"][layout] for layout in LAYOUTS)
    lines += ["", f"PD / colocated: ITL p99 {pd['itl_p99_ms'] / colocated['itl_p99_ms']:.2f}x, "
                  f"ITL p50 {pd['itl_p50_ms'] / colocated['itl_p50_ms']:.2f}x, "
                  f"TTFT p50 {pd['ttft_p50_ms'] / colocated['ttft_p50_ms']:.2f}x"]
    return "\n".join(lines)


@drawing
def plot(report: dict, path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    layouts = list(report["load"])
    for ax, (metric, title) in zip(axes, (("itl", "decode inter-token latency (ms)"),
                                          ("ttft", "long-prompt time to first token (ms)"))):
        grouped_bars(ax, layouts, {q: [report["load"][name][f"{metric}_{q}_ms"] for name in layouts]
                                   for q in ("p50", "p99")})
        ax.set_title(title)
        ax.legend()
    fig.suptitle(f"{report['decode_streams']} decoding streams, a {report['long_prompt_tokens']}-token prompt every "
                 f"{report['interval']} s")
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decode-streams", type=int, default=8)
    parser.add_argument("--decode-tokens", type=int, default=1024)
    parser.add_argument("--long-prompt-tokens", type=int, default=2048 - LONG_PROMPT_OUTPUT)
    parser.add_argument("--arrivals", type=int, default=10)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--out", type=Path, default=Path("bench-out/disaggregation"))
    args = parser.parse_args()

    tokenizer = Tokenizer(DEFAULT_MODEL_DIR)
    longest = max(args.long_prompt_tokens, *HANDOFF_PROMPTS)
    texts = package_prompts(tokenizer, PACKAGE, args.arrivals + len(HANDOFF_PROMPTS), longest)
    handoff_prompts = {tokens: texts[i][:tokens] for i, tokens in enumerate(HANDOFF_PROMPTS)}
    long_prompts = [ids[: args.long_prompt_tokens] for ids in texts[len(HANDOFF_PROMPTS):]]
    decode_prompts = [ids[:64] for ids in package_prompts(tokenizer, PACKAGE, args.decode_streams, 64)]
    report = {"package": PACKAGE, "decode_streams": args.decode_streams, "decode_tokens": args.decode_tokens,
              "long_prompt_tokens": args.long_prompt_tokens, "arrivals": args.arrivals, "interval": args.interval,
              "load": {}}
    for layout, options in LAYOUTS.items():
        with tempfile.TemporaryDirectory() as tmp:
            mesh = start_mesh(Path(tmp), *options)
            try:
                if "handoff" not in report:
                    report["handoff"] = handoff_cost(mesh, handoff_prompts)
                report["load"][layout] = row = asyncio.run(mixed_load(
                    mesh.base_url, mesh.model, decode_prompts, long_prompts, args.decode_tokens, args.interval
                ))
            finally:
                mesh.stop()
        print(f"{layout}: {row}", flush=True)
    table = markdown_table(report)
    print(table)
    save_report(args.out, "disaggregation", report, table, plot)


if __name__ == "__main__":
    sys.exit(main())
