"""Each speculative method against plain decoding through the mesh, their passes taking turns on two meshes: whether a
method is faster than naive, measured so that the machine's drift cannot decide it.

    python -m benchmarks.mesh_ab [--methods draft_model eagle3] [--streams 1] [--requests 16] [--rounds 5]
                                 [--prompts held-out|PACKAGE|FILE] [--max-tokens 128] [--prompt-tokens 96]
                                 [--temperature 0] [--out bench-out/mesh-ab]

benchmarks/speculation.py runs one method's mesh after another's, minutes apart; on a shared 2-core machine the same
pass drifts by 10% and more within minutes, as much as the methods differ at one stream. Here a mesh on naive and a
mesh on the method run side by side, each idle while the other serves, and their passes alternate: naive, method,
naive, ..., naive. A method pass's ratio is its tokens/s over the mean of the naive passes on either side; the figure
is the median over --rounds, beside the smallest and the largest. Every pass serves the same --requests requests,
`streams` at a time (benchmarks/mesh_client.py), each --max-tokens tokens long (EOS ignored), after one untimed pass
on each mesh. Both meshes are `specmesh up` on its defaults but the method (benchmarks/speculation.py's METHODS).

Prompts: the openings of held-out standard-library files, as benchmarks/speculation.py's (--prompts held-out), or of
an installed package's files, as benchmarks/heldout.py's (--prompts aiohttp: code neither the demo model nor any of
its drafters trained on, in another project's style), or windows of a text file's tokens (--prompts FILE: for
instance aiperf's dataset/generator/assets/shakespeare.txt, the prose its synthetic prompts sample, which the demo
model never saw).

Greedy (--temperature 0): every method's text must equal naive's (exit status 1 otherwise); above, requests are
seeded. Writes mesh_ab.json, mesh_ab.png and table.md to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.heldout import package_prompts, text_prompts
from benchmarks.mesh_client import mesh_streams
from benchmarks.methods import GREEDY
from benchmarks.plot import plot_mesh_ab, save_report
from benchmarks.speculation import HELD_OUT, METHODS, MIN_REQUESTS, bracketed_ratios, prompt_sets
from services.mesh_process import Mesh, start_mesh
from shared.config import DEFAULT_MODEL_DIR
from shared.tokenizer import Tokenizer

BASELINE = "naive"
DEFAULT_METHODS = ("draft_model", "eagle3")
ROUNDS = 5
STREAMS = 1
PROMPT_TOKENS = 96


def mesh_pass(mesh: Mesh, prompts: list[list[int]], args: argparse.Namespace) -> tuple[float, list[str]]:
    """tokens/s of one pass over every prompt, and the texts."""
    streams, seconds = asyncio.run(
        mesh_streams(mesh.base_url, mesh.model, prompts, args.streams, args.max_tokens, args.temperature)
    )
    return len(prompts) * args.max_tokens / seconds, [s.text for s in streams]


def compare(args: argparse.Namespace, baseline: Mesh, name: str, prompts: list[list[int]],
            expected: list[str] | None, tmp: Path) -> tuple[dict, bool]:
    """One method's alternating passes against the baseline mesh: its row, and whether its text was the baseline's
    (always true when sampling)."""
    tmp.mkdir(parents=True, exist_ok=True)
    mesh = start_mesh(tmp, "--speculative-config", json.dumps(METHODS[name]), "--max-num-seqs", str(args.streams),
                      model=args.model)
    try:
        mesh_pass(mesh, prompts, args)
        baseline_rates, texts = [mesh_pass(baseline, prompts, args)[0]], None
        method_rates = []
        for _ in range(args.rounds):
            rate, texts = mesh_pass(mesh, prompts, args)
            method_rates.append(rate)
            baseline_rates.append(mesh_pass(baseline, prompts, args)[0])
    finally:
        mesh.stop()
    by_round = bracketed_ratios(baseline_rates, method_rates)
    row = {
        "method": name, "streams": args.streams, "requests": len(prompts),
        "baseline_tokens_per_s": statistics.median(baseline_rates), "tokens_per_s": statistics.median(method_rates),
        "ratio": statistics.median(by_round), "ratio_min": min(by_round), "ratio_max": max(by_round),
        "ratio_by_round": by_round, "baseline_passes": baseline_rates, "method_passes": method_rates,
    }
    print(json.dumps({k: row[k] for k in ("method", "tokens_per_s", "baseline_tokens_per_s", "ratio")}), flush=True)
    return row, expected is None or texts == expected


def markdown_table(rows: list[dict]) -> str:
    lines = [f"| method | streams | {BASELINE} mesh tok/s | method mesh tok/s | method / {BASELINE} | rounds' range |",
             "|---|---:|---:|---:|---:|---|"]
    lines += [f"| {r['method']} | {r['streams']} | {r['baseline_tokens_per_s']:.0f} | {r['tokens_per_s']:.0f} | "
              f"{r['ratio']:.2f}x | {r['ratio_min']:.2f}-{r['ratio_max']:.2f}x |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS),
                        choices=sorted({spec["method"] for spec in METHODS.values()} - {BASELINE}))
    parser.add_argument("--streams", type=int, default=STREAMS)
    parser.add_argument("--requests", type=int, default=MIN_REQUESTS, help="requests a pass serves")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="timed passes of each method")
    parser.add_argument("--prompts", default=HELD_OUT,
                        help=f"{HELD_OUT} (standard-library files), an installed package whose files open prompts, "
                        "or a text file whose windows are the prompts")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
    parser.add_argument("--temperature", type=float, default=GREEDY)
    parser.add_argument("--out", type=Path, default=Path("bench-out/mesh-ab"))
    args = parser.parse_args()
    tokenizer = Tokenizer(args.model)
    if args.prompts == HELD_OUT:
        prompts = prompt_sets(tokenizer, args.requests, args.prompt_tokens)[HELD_OUT]
    elif Path(args.prompts).is_file():
        prompts = text_prompts(tokenizer, Path(args.prompts), args.requests, args.prompt_tokens)
    else:
        prompts = package_prompts(tokenizer, args.prompts, args.requests, args.prompt_tokens)
    names = [name for name, spec in METHODS.items() if spec["method"] in args.methods]
    rows, mismatches = [], []
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / BASELINE).mkdir()
        baseline = start_mesh(Path(tmp) / BASELINE, "--speculative-config", json.dumps(METHODS[BASELINE]),
                              "--max-num-seqs", str(args.streams), model=args.model)
        try:
            expected = mesh_pass(baseline, prompts, args)[1] if args.temperature == GREEDY else None
            for name in names:
                row, same = compare(args, baseline, name, prompts, expected, Path(tmp) / name)
                rows.append(row)
                if not same:
                    mismatches.append(name)
        finally:
            baseline.stop()
    text = markdown_table(rows)
    print("\n" + text + "\n")
    if args.temperature == GREEDY:
        print("greedy check: " + ("OK" if not mismatches else "MISMATCH in " + ", ".join(mismatches)))
    report = {
        "model": str(args.model), "prompts": args.prompts, "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens, "temperature": args.temperature, "rounds": args.rounds,
        "baseline": BASELINE, "rows": rows, "greedy_mismatches": mismatches,
    }
    save_report(args.out, "mesh_ab", report, text, plot_mesh_ab)
    if mismatches:
        sys.exit(1)


if __name__ == "__main__":
    main()
