"""Real q against point-mass q (the user's seed 003): the acceptance length and tokens/s of the model drafters (MTP,
the draft model and the EAGLE-3 head shipped beside the demo model) when verification reads their drafts' real q,
against the same
drafts verified as point masses (q(x) = 1, as most servers do), at temperatures 0.5, 1.0 and 1.5.

    python -m benchmarks.draft_q [--batches 1 8] [--temperatures 0.5 1.0 1.5] [--max-tokens 96] [--prompts 8]
        [--out bench-out/draft-q]

In-process engine on the demo model, its defaults otherwise, k = 3; prompts: openings of aiohttp's files, code the
demo model never trained on; seeded, so both runs of a pair sample the same noise. Acceptance length =
1 + accepted drafts / steps that verified drafts. Both are lossless; only how many drafts survive differs. Writes
draft-q.json, its PNG and table.md to --out.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from pathlib import Path

from benchmarks.heldout import PACKAGE, package_prompts
from benchmarks.plot import drawing, grouped_bars, plt, save_figure, save_report
from shared.config import DEFAULT_MODEL_DIR, EngineConfig, SpeculativeConfig
from shared.schemas import SamplingParams, WorkRequest
from shared.tokenizer import Tokenizer
from services.worker.engine.engine import Engine

# Every chain drafts its k tokens (min_draft_confidence 0): the comparison is of q alone, on the same drafts.
FULL_CHAINS = {"min_draft_confidence": 0.0}
DRAFTERS = {
    "mtp k=3 steps=3": {"method": "mtp", "num_speculative_tokens": 3, "num_model_steps": 3} | FULL_CHAINS,
    "draft_model k=3": {"method": "draft_model", "num_speculative_tokens": 3} | FULL_CHAINS,
    "eagle3 k=3": {"method": "eagle3", "num_speculative_tokens": 3} | FULL_CHAINS,  # models/specmesh-demo-eagle3
}
Q_MODES = ("model", "point_mass")
PROMPT_TOKENS = 64


def run(spec: dict, q_mode: str, batch: int, temperature: float, prompts: list[list[int]], max_tokens: int) -> dict:
    engine = Engine(EngineConfig(max_num_seqs=batch, speculative=SpeculativeConfig(**spec, draft_q=q_mode)))
    requests = [
        WorkRequest(request_id=uuid.uuid4().hex, prompt_token_ids=ids, created=0.0, sampling=SamplingParams(
            temperature=temperature, seed=i, max_tokens=max_tokens, ignore_eos=True))
        for i, ids in enumerate(prompts)
    ]
    started = time.perf_counter()
    tokens = 0
    for first in range(0, len(requests), batch):
        for request in requests[first : first + batch]:
            engine.add_request(request)
        while engine.has_work():
            tokens += sum(len(o.tokens) for o in engine.step())
    seconds = time.perf_counter() - started
    stats = engine.stats
    return {"acceptance_length": 1 + stats.num_accepted_tokens / max(stats.num_drafts, 1),
            "tokens_per_s": tokens / seconds}


def markdown_table(rows: list[dict]) -> str:
    lines = ["| drafter | batch | T | acceptance length, real q | point-mass q | tok/s, real q | point-mass q |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['drafter']} | {r['batch']} | {r['temperature']} | {r['model']['acceptance_length']:.2f} | "
                     f"{r['point_mass']['acceptance_length']:.2f} | {r['model']['tokens_per_s']:.0f} | "
                     f"{r['point_mass']['tokens_per_s']:.0f} |")
    return "\n".join(lines)


@drawing
def plot(report: dict, path: Path) -> None:
    rows = report["rows"]
    labels = [f"{r['drafter'].split()[0]}\nb{r['batch']} T={r['temperature']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.9), 4))
    grouped_bars(ax, labels, {mode: [r[mode]["acceptance_length"] for r in rows] for mode in Q_MODES})
    ax.set_ylabel("acceptance length")
    ax.set_title("verified against the drafter's real q, or as point masses")
    ax.legend(["real q", "point-mass q"])
    ax.tick_params(axis="x", labelsize=7)
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.5, 1.0, 1.5])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("bench-out/draft-q"))
    args = parser.parse_args()
    prompts = package_prompts(Tokenizer(DEFAULT_MODEL_DIR), PACKAGE, args.prompts, PROMPT_TOKENS)
    rows = []
    for name, spec in DRAFTERS.items():
        for batch in args.batches:
            for temperature in args.temperatures:
                row = {"drafter": name, "batch": batch, "temperature": temperature}
                for mode in Q_MODES:
                    row[mode] = run(spec, mode, batch, temperature, prompts, args.max_tokens)
                print(row, flush=True)
                rows.append(row)
    table = markdown_table(rows)
    print(table)
    save_report(args.out, "draft-q", {"rows": rows, "max_tokens": args.max_tokens, "prompts": args.prompts},
                table, plot)


if __name__ == "__main__":
    sys.exit(main())
