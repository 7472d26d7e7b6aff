"""In bfloat16, the share of sequences whose speculative greedy output equals plain decoding's, by batch.

    python -m benchmarks.agreement [--device cuda] [--model DIR] [--dtype bfloat16] [--batches 1 32]
        [--methods "ngram k=3" "mtp k=3 steps=3"] [--prompts 32] [--max-tokens 64] [--prompt-tokens 64]
        [--out bench-out/agreement]

In float32 every lossless method gives naive's greedy tokens (tests/test_cuda.py holds them to transformers'). In
bfloat16 a verify pass (several query rows per sequence) and a decode pass (one) add up in other orders, so a
near-tie can break the other way and the sequence go on differently from there: this measures how often, it checks
nothing. At each batch, naive and every method serve the same held-out prompts (benchmarks/methods.py's, max(batch,
--prompts) of them) with max_num_seqs = batch; a sequence agrees when its whole output equals naive's at that batch.
Prints a table and writes agreement.json to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from benchmarks.methods import BASELINE, GREEDY, METHODS, first_difference, load_prompts, run_engine
from shared.config import DEFAULT_MODEL_DIR
from shared.tokenizer import Tokenizer

BATCHES = (1, 32)
DEFAULT_METHODS = ("ngram k=3", "mtp k=3 steps=3")
DEFAULT_PROMPTS = 32
DEFAULT_MAX_TOKENS = 64
DEFAULT_PROMPT_TOKENS = 64


def agreement_rows(args: argparse.Namespace, prompts: list[list[int]]) -> list[dict]:
    """Per batch and method: how many sequences came out exactly as naive's at that batch, and where the others
    first left it."""
    rows = []
    for batch in args.batches:
        mine = prompts[: max(batch, args.prompts)]

        def serve(name: str) -> list[list[int]]:
            return run_engine(args.model, name, METHODS[name], batch, mine, args.max_tokens, GREEDY,
                              device=args.device, dtype=args.dtype).outputs

        reference = serve(BASELINE)
        for name in args.methods:
            departures = [first_difference(o, r) for o, r in zip(serve(name), reference) if o != r]
            rows.append({
                "method": name, "batch": batch, "sequences": len(mine),
                "agreeing": len(mine) - len(departures), "share": 1 - len(departures) / len(mine),
                "median_first_difference": statistics.median(departures) if departures else None,
            })
            print(json.dumps(rows[-1]), flush=True)
    return rows


def markdown_table(rows: list[dict]) -> str:
    lines = ["| method | batch | sequences equal to naive's | share | median first different token |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        where = "–" if r["median_first_difference"] is None else f"{r['median_first_difference']:g}"
        lines.append(f"| {r['method']} | {r['batch']} | {r['agreeing']} / {r['sequences']} | {r['share']:.2f} "
                     f"| {where} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU machine")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--methods", nargs="+", choices=[m for m in METHODS if m != BASELINE],
                        default=list(DEFAULT_METHODS))
    parser.add_argument("--prompts", type=int, default=DEFAULT_PROMPTS, help="prompts per batch at least")
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    parser.add_argument("--prompt-tokens", type=int, default=DEFAULT_PROMPT_TOKENS)
    parser.add_argument("--out", type=Path, default=Path("bench-out/agreement"))
    args = parser.parse_args()
    if min(args.batches + [args.prompts, args.max_tokens, args.prompt_tokens]) < 1:
        parser.error("--batches, --prompts, --max-tokens and --prompt-tokens take positive numbers")
    prompts = load_prompts(Tokenizer(args.model), max(args.batches + [args.prompts]), args.prompt_tokens)
    rows = agreement_rows(args, prompts)
    text = markdown_table(rows)
    print("\n" + text)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"model": str(args.model), "device": args.device, "dtype": args.dtype, "max_tokens": args.max_tokens,
              "prompt_tokens": args.prompt_tokens, "torch_version": torch.__version__, "rows": rows}
    (args.out / "agreement.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out / 'agreement.json'}")


if __name__ == "__main__":
    main()
