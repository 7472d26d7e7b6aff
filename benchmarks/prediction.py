"""Predicted outputs, measured: a chat answer requested again with a prediction of it, whole or edited, against the
same request without one, through the whole mesh (`specmesh up` on its defaults, and with 8 drafts a step).

    python -m benchmarks.prediction [--drafts 3 8] [--rounds 5] [--max-tokens 200] [--out bench-out/prediction]

Per --drafts value, one mesh (`--speculative-config '{"num_speculative_tokens": K}'`; the rest are the defaults:
ngram, adaptive). Per round, a fresh prompt: the opening of one of aiohttp's files (text the demo model never saw,
as benchmarks/heldout.py takes them) as the user message. Its greedy answer is requested without a prediction, then
with the answer itself as the prediction ("exact"), then with a line of it replaced ("edited", as a client asking
for a small change predicts the file it sent); the three take turns. Each must return the same text (exit status 1
otherwise). Figures: median seconds per request, output tokens/s, the speculation summary's acceptance length and
usage.completion_tokens_details.

Writes prediction.json and table.md to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import openai

from benchmarks.heldout import PACKAGE, package_prompts
from services.mesh_process import start_mesh
from shared.config import DEFAULT_MODEL_DIR
from shared.tokenizer import Tokenizer

PROMPT_TOKENS = 200
EDIT = "# a line the answer does not have\n"
CASES = ("no prediction", "exact", "edited")


def _edited(text: str) -> str:
    """The answer with the line at its middle replaced."""
    lines = text.splitlines(keepends=True)
    middle = len(lines) // 2
    return "".join(lines[:middle] + [EDIT] + lines[middle + 1 :])


def _request(client: openai.OpenAI, model: str, prompt: str, max_tokens: int, prediction: str | None) -> dict:
    extra = {"prediction": {"type": "content", "content": prediction}} if prediction is not None else {}
    started = time.perf_counter()
    response = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
        extra_body={"speculative": {"return_stats": True}}, **extra,
    )
    seconds = time.perf_counter() - started
    details = response.usage.completion_tokens_details
    return {
        "text": response.choices[0].message.content,
        "seconds": seconds,
        "tokens": response.usage.completion_tokens,
        "acceptance_length": response.usage.model_extra["speculative"]["mean_acceptance_length"],
        "accepted_prediction_tokens": None if details is None else details.accepted_prediction_tokens,
        "rejected_prediction_tokens": None if details is None else details.rejected_prediction_tokens,
    }


def run_drafts(drafts: int, prompts: list[str], max_tokens: int) -> dict[str, list[dict]]:
    config = json.dumps({"num_speculative_tokens": drafts})
    results: dict[str, list[dict]] = {case: [] for case in CASES}
    with tempfile.TemporaryDirectory() as tmp:
        mesh = start_mesh(Path(tmp), "--speculative-config", config)
        try:
            client = openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0, timeout=300)
            _request(client, mesh.model, prompts[0], 8, None)  # warm-up
            for prompt in prompts:
                plain = _request(client, mesh.model, prompt, max_tokens, None)
                runs = {
                    "no prediction": plain,
                    "exact": _request(client, mesh.model, prompt, max_tokens, plain["text"]),
                    "edited": _request(client, mesh.model, prompt, max_tokens, _edited(plain["text"])),
                }
                for case, run in runs.items():
                    if run["text"] != plain["text"]:
                        print(f"{drafts} drafts, {case}: the answer changed", file=sys.stderr)
                        raise SystemExit(1)
                    results[case].append(run)
        finally:
            mesh.stop()
    return results


def summary(runs: list[dict]) -> dict:
    median = statistics.median
    accepted = [r["accepted_prediction_tokens"] for r in runs if r["accepted_prediction_tokens"] is not None]
    rejected = [r["rejected_prediction_tokens"] for r in runs if r["rejected_prediction_tokens"] is not None]
    return {
        "seconds": median(r["seconds"] for r in runs),
        "tokens_per_s": median(r["tokens"] / r["seconds"] for r in runs),
        "acceptance_length": median(r["acceptance_length"] for r in runs),
        "accepted_prediction_tokens": median(accepted) if accepted else None,
        "rejected_prediction_tokens": median(rejected) if rejected else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafts", type=int, nargs="+", default=[3, 8])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("bench-out/prediction"))
    args = parser.parse_args()
    tokenizer = Tokenizer(DEFAULT_MODEL_DIR)
    prompts = [tokenizer.decode(ids) for ids in package_prompts(tokenizer, PACKAGE, args.rounds, PROMPT_TOKENS)]
    figures = {}
    rows = ["| drafts a step | prediction | s per request | output tok/s | acceptance length | accepted / rejected "
            "prediction tokens | speed-up |", "|---:|---|---:|---:|---:|---|---:|"]
    for drafts in args.drafts:
        results = run_drafts(drafts, prompts, args.max_tokens)
        figures[drafts] = {case: summary(runs) for case, runs in results.items()}
        base = figures[drafts]["no prediction"]["seconds"]
        for case, s in figures[drafts].items():
            counted = "-" if s["accepted_prediction_tokens"] is None else (
                f"{s['accepted_prediction_tokens']:g} / {s['rejected_prediction_tokens']:g}"
            )
            rows.append(f"| {drafts} | {case} | {s['seconds']:.3f} | {s['tokens_per_s']:.0f} | "
                        f"{s['acceptance_length']:.2f} | {counted} | {base / s['seconds']:.2f}x |")
    table = "\n".join(rows)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prediction.json").write_text(json.dumps(
        {"max_tokens": args.max_tokens, "rounds": args.rounds, "prompt_tokens": PROMPT_TOKENS, "figures": figures},
        indent=2,
    ))
    (args.out / "table.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
