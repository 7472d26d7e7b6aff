"""Prefix-aware routing, measured: the prefix cache's hit rate of a multi-turn chat workload on a mesh of several
workers, with requests routed to the worker holding their conversation against the shared queue alone.

    python -m benchmarks.prefix_routing [--workers 1 2 4] [--conversations 8] [--turns 5] [--rounds 3]
        [--system-prompt-tokens 0] [--out bench-out/prefix-routing]

Per worker count and routing, one `specmesh up --workers N` (one worker: what the workload can hit at all, the same
either way) (`--prefix-routing` or `--no-prefix-routing`, otherwise
its defaults). The workload: --conversations chats at once, each opening with its own ~300-token user message (the
opening of one of aiohttp's files, code the demo model never saw), then --turns turns back to back, each answered
with up to 32 tokens (greedy) and followed by a short new user message (with --system-prompt-tokens, after one
system message every chat shares); a fresh `cache_salt` per round, so that no
round finds what another left. The figure: the share of the prompt tokens of turns 2.. that the workers found cached
(`usage.prompt_tokens_details.cached_tokens`), over all conversations; median over rounds. Writes
prefix-routing.json, its PNG and table.md to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

import aiohttp

from benchmarks.heldout import PACKAGE, package_prompts
from benchmarks.mesh_client import HTTP_TIMEOUT_S
from benchmarks.plot import plot_prefix_routing, save_report
from services.mesh_process import start_mesh
from shared.config import DEFAULT_MODEL_DIR
from shared.tokenizer import Tokenizer

OPENING_TOKENS, ANSWER_TOKENS = 300, 32
ROUTINGS = {"shared queue": "--no-prefix-routing", "prefix-aware": "--prefix-routing"}


async def conversation(session: aiohttp.ClientSession, url: str, model: str, opening: str, turns: int,
                       salt: str, system: str | None) -> tuple[int, int]:
    """One chat, turn after turn; (prompt tokens, cached tokens) of its turns after the first."""
    messages = [{"role": "user", "content": opening}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    prompt = cached = 0
    for turn in range(turns):
        body = {"model": model, "messages": messages, "max_tokens": ANSWER_TOKENS, "temperature": 0,
                "cache_salt": salt}
        async with session.post(url, json=body) as response:
            response.raise_for_status()
            answer = await response.json()
        if turn:
            prompt += answer["usage"]["prompt_tokens"]
            cached += answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        messages += [
            {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
            {"role": "user", "content": f"Now explain part {turn + 1} of it."},
        ]
    return prompt, cached


async def one_round(base_url: str, model: str, openings: list[str], turns: int, system: str | None) -> float:
    url = f"{base_url}/chat/completions"
    salt = uuid.uuid4().hex
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S)) as session:
        totals = await asyncio.gather(*(conversation(session, url, model, o, turns, salt, system)
                                        for o in openings))
    return sum(c for _, c in totals) / sum(p for p, _ in totals)


def markdown_table(rows: list[dict]) -> str:
    lines = ["| workers | shared queue | prefix-aware | ratio |", "|---|---|---|---|"]
    for row in rows:
        lines.append(
            f"| {row['workers']} | {row['shared queue']:.3f} | {row['prefix-aware']:.3f} | "
            f"{row['prefix-aware'] / row['shared queue']:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4], help="1: the workload's ceiling")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--num-kv-blocks", type=int, default=None,
        help="each worker's KV cache (default: a whole context per batch slot): smaller than the chats' working set "
        "measures the cache under pressure",
    )
    parser.add_argument(
        "--system-prompt-tokens", type=int, default=0,
        help="one system message of about this many tokens opens every chat, as an agent's or a product's does "
        "(0: none)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench-out/prefix-routing"))
    args = parser.parse_args()
    if not 0 <= args.system_prompt_tokens < OPENING_TOKENS:
        parser.error(f"--system-prompt-tokens must be in [0, {OPENING_TOKENS - 1}]")

    tokenizer = Tokenizer(DEFAULT_MODEL_DIR)
    texts = [ids[1:] for ids in package_prompts(tokenizer, PACKAGE, args.conversations + 1, OPENING_TOKENS)]
    openings = [tokenizer.decode(ids) for ids in texts[: args.conversations]]
    system = tokenizer.decode(texts[-1][: args.system_prompt_tokens]) if args.system_prompt_tokens else None
    rows, runs = [], {}
    for workers in args.workers:
        row = {"workers": workers}
        for name, option in ROUTINGS.items():
            with tempfile.TemporaryDirectory() as tmp:
                kv = ["--num-kv-blocks", str(args.num_kv_blocks)] if args.num_kv_blocks else []
                mesh = start_mesh(Path(tmp), "--workers", str(workers), option, *kv)
                try:
                    rates = [asyncio.run(one_round(mesh.base_url, mesh.model, openings, args.turns, system))
                             for _ in range(args.rounds)]
                finally:
                    mesh.stop()
            runs[f"{workers} workers, {name}"] = rates
            row[name] = statistics.median(rates)
            print(f"{workers} workers, {name}: hit rates {[round(r, 3) for r in rates]}", flush=True)
        rows.append(row)
    report = {"package": PACKAGE, "conversations": args.conversations, "turns": args.turns, "rounds": args.rounds,
              "num_kv_blocks": args.num_kv_blocks, "system_prompt_tokens": args.system_prompt_tokens, "rows": rows, "runs": runs}
    table = markdown_table(rows)
    print(table)
    save_report(args.out, "prefix-routing", report, table, plot_prefix_routing)


if __name__ == "__main__":
    sys.exit(main())
