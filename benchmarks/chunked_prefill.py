"""Chunked prefill, measured: what a prompt of the whole context does to the streams already running, through the
mesh (`specmesh up` on its defaults but the prefill options), on code the demo model never saw.

    python -m benchmarks.chunked_prefill [--budgets 256 512] [--streams 8] [--arrivals 3] [--rounds 4]
        [--out bench-out/chunked-prefill]

Per configuration (unchunked, and each --max-num-batched-tokens of --budgets), one mesh with a batch slot more than
--streams (`--max-num-seqs`, otherwise its defaults); per round, --streams greedy
streams of 64-token prompts decode (EOS ignored) while --arrivals long requests (1,900-token prompts, the context
less their 16 tokens, each with its own `cache_salt` so that the prefix cache cannot help) arrive one after another.
The figures, over the window from the first arrival to the last long request's end: the running streams' worst
gap between two chunks, their p99 gap, their tokens per second, and the long requests' time to first token. Rounds
alternate the configurations; each figure is the median over rounds. Writes chunked-prefill.json, its PNG and
table.md to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp
import numpy as np
import orjson

from benchmarks.heldout import PACKAGE, package_prompts
from benchmarks.mesh_client import HTTP_TIMEOUT_S
from benchmarks.plot import plot_chunked_prefill, save_report
from services.mesh_process import start_mesh
from shared.config import DEFAULT_MODEL_DIR
from shared.tokenizer import Tokenizer

SHORT_TOKENS, LONG_TOKENS, LONG_MAX_TOKENS = 64, 1900, 16
SETTLE_S = 1.0  # the streams decode this long before the first long prompt arrives
ARRIVAL_GAP_S = 0.5  # between one long request's end and the next one's arrival
UNCHUNKED = "unchunked"


async def stream(session: aiohttp.ClientSession, url: str, body: dict, arrivals: list[tuple[float, int]]) -> None:
    """One streamed completion, appending per chunk (perf_counter when it arrived, tokens it carried)."""
    async with session.post(url, json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if line.startswith(b"data: {"):
                event = orjson.loads(line[len(b"data: "):])
                if "error" in event:
                    raise RuntimeError(f"the mesh failed a request: {event['error']}")
                for choice in event["choices"]:
                    arrivals.append((time.perf_counter(), len(choice["token_ids"])))


async def one_round(base_url: str, model: str, short: list[list[int]], long: list[list[int]]) -> dict:
    url = f"{base_url}/completions"
    common = {"model": model, "temperature": 0, "stream": True, "ignore_eos": True, "return_token_ids": True}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S)) as session:
        # The running streams may generate up to the context's end; they are cancelled once the arrivals are over.
        short_arrivals: list[list[tuple[float, int]]] = [[] for _ in short]
        streams = [
            asyncio.create_task(stream(session, url, {**common, "prompt": ids, "max_tokens": LONG_TOKENS}, arrivals))
            for ids, arrivals in zip(short, short_arrivals)
        ]
        await asyncio.sleep(SETTLE_S)
        windows, ttfts = [], []
        for ids in long:
            sent = time.perf_counter()
            body = {**common, "prompt": ids, "max_tokens": LONG_MAX_TOKENS, "cache_salt": uuid.uuid4().hex}
            arrivals: list[tuple[float, int]] = []
            await stream(session, url, body, arrivals)
            ttfts.append(arrivals[0][0] - sent)
            windows.append((sent, arrivals[-1][0]))
            await asyncio.sleep(ARRIVAL_GAP_S)
        for task in streams:
            if task.done():
                raise SystemExit(f"a running stream ended before the long prompts were done: {task.exception()!r}")
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
    start, end = windows[0][0], windows[-1][1]
    gaps, tokens = [], 0
    for arrivals in short_arrivals:
        inside = [(t, n) for t, n in arrivals if start <= t <= end]
        tokens += sum(n for _, n in inside)
        gaps += list(np.diff([t for t, _ in inside]))
    return {
        "worst_gap_ms": 1e3 * max(gaps), "p99_gap_ms": 1e3 * float(np.percentile(gaps, 99)),
        "tokens_per_s": tokens / (end - start), "long_ttft_ms": 1e3 * statistics.median(ttfts),
    }


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| prefill | worst gap ms | p99 gap ms | running streams tok/s | long prompt TTFT ms |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['config']} | {row['worst_gap_ms']:.0f} | {row['p99_gap_ms']:.1f} | {row['tokens_per_s']:.0f} | "
            f"{row['long_ttft_ms']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--arrivals", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("bench-out/chunked-prefill"))
    args = parser.parse_args()

    tokenizer = Tokenizer(DEFAULT_MODEL_DIR)
    short = package_prompts(tokenizer, PACKAGE, args.streams, SHORT_TOKENS)
    long = package_prompts(tokenizer, PACKAGE, args.arrivals, LONG_TOKENS)
    configs = {UNCHUNKED: ["--no-chunked-prefill"]}
    configs |= {f"chunks of {b}": ["--max-num-batched-tokens", str(b)] for b in args.budgets}
    results: dict[str, list[dict]] = {name: [] for name in configs}
    for round_no in range(args.rounds):
        for name, options in configs.items():
            with tempfile.TemporaryDirectory() as tmp:
                # One slot more than the running streams, for the long prompt to arrive in.
                mesh = start_mesh(Path(tmp), "--max-num-seqs", str(args.streams + 1), *options)
                try:
                    results[name].append(asyncio.run(one_round(mesh.base_url, mesh.model, short, long)))
                finally:
                    mesh.stop()
            print(f"round {round_no + 1}: {name}: {results[name][-1]}", flush=True)
    rows = [
        {"config": name, **{key: statistics.median(r[key] for r in runs) for key in runs[0]}}
        for name, runs in results.items()
    ]
    report = {"package": PACKAGE, "streams": args.streams, "arrivals": args.arrivals, "rounds": args.rounds,
              "long_prompt_tokens": LONG_TOKENS, "rows": rows, "runs": results}
    table = markdown_table(rows)
    print(table)
    save_report(args.out, "chunked-prefill", report, table, plot_chunked_prefill)


if __name__ == "__main__":
    sys.exit(main())
