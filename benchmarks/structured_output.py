"""What a grammar costs and what its forced tokens give, in the engine on the demo model (its defaults otherwise).

    python -m benchmarks.structured_output [--requests 16] [--max-tokens 96] [--rounds 3]
        [--out bench-out/structured-output]

A JSON-schema workload: each request asks for a record (a name, a city, an enum, bounded integers, a boolean, a
short list) under the schema, greedy, up to --max-tokens; the same prompts unconstrained (ignore_eos, so they
emit as many tokens) are the baseline. Per method (naive, ngram) and batch (1: requests one after another; 8: eight
at a time): tokens/s with the schema against without it, and tokens per step (emitted tokens over the steps each
request emitted in) with the grammar's forced tokens drafted (the default) and without (`grammar_drafts: false`).
Median over --rounds. Writes structured-output.json, its PNG and table.md to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

from benchmarks.plot import drawing, grouped_bars, plt, save_figure, save_report
from shared.config import DEFAULT_MODEL_DIR, EngineConfig, SpeculativeConfig
from shared.schemas import SamplingParams, WorkRequest
from shared.structured import StructuredOutput
from shared.tokenizer import Tokenizer
from services.worker.engine.engine import Engine

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "city": {"type": "string", "maxLength": 16},
        "kind": {"enum": ["person", "company", "place"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "integer", "minimum": 0, "maximum": 1000},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
    },
    "required": ["name", "city", "kind", "age", "score", "active", "tags"],
    "additionalProperties": False,
}
SUBJECTS = ("a baker", "a bank", "a harbour", "a teacher", "a startup", "a museum", "a pilot", "a village")
METHODS = ("naive", "ngram")
BATCHES = (1, 8)


def requests(tokenizer: Tokenizer, count: int, max_tokens: int, constrained: bool) -> list[WorkRequest]:
    structured = StructuredOutput(kind="json_schema", spec=json.dumps(SCHEMA)) if constrained else None
    return [
        WorkRequest(
            request_id=uuid.uuid4().hex,
            prompt_token_ids=tokenizer.encode(f"Describe {SUBJECTS[i % len(SUBJECTS)]} as a JSON record: "),
            sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=not constrained,
                                    structured=structured),
            created=0.0,
        )
        for i in range(count)
    ]


def run(engine: Engine, batch: list[WorkRequest], width: int) -> tuple[int, float, int]:
    """(tokens emitted, seconds, request-steps that emitted) for `batch`, `width` requests at a time."""
    tokens = steps = 0
    started = time.perf_counter()
    for first in range(0, len(batch), width):
        for request in batch[first : first + width]:
            engine.add_request(request)
        while engine.has_work():
            outputs = engine.step()
            tokens += sum(len(o.tokens) for o in outputs)
            steps += sum(1 for o in outputs if o.tokens)
    return tokens, time.perf_counter() - started, steps


def measure(method: str, width: int, args: argparse.Namespace, tokenizer: Tokenizer) -> dict:
    row = {"method": method, "batch": width}
    for name, constrained, grammar_drafts in (("plain", False, True), ("schema", True, True),
                                              ("schema_no_forced", True, False)):
        engine = Engine(EngineConfig(speculative=SpeculativeConfig(method=method, grammar_drafts=grammar_drafts)))
        run(engine, requests(tokenizer, min(width, 2), 8, constrained), width)  # warm-up, grammar compiled
        rates, per_step = [], []
        for _ in range(args.rounds):
            batch = requests(tokenizer, args.requests, args.max_tokens, constrained)
            tokens, seconds, steps = run(engine, batch, width)
            rates.append(tokens / seconds)
            per_step.append(tokens / steps)
        row[f"{name}_tokens_per_s"] = statistics.median(rates)
        row[f"{name}_tokens_per_step"] = statistics.median(per_step)
        print(f"{method} batch {width} {name}: {row[f'{name}_tokens_per_s']:.0f} tok/s, "
              f"{row[f'{name}_tokens_per_step']:.2f} tokens/step", flush=True)
    return row


def markdown_table(rows: list[dict]) -> str:
    lines = ["| method | batch | tok/s plain | tok/s schema | ratio | tokens/step schema | without forced drafts |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['batch']} | {r['plain_tokens_per_s']:.0f} | {r['schema_tokens_per_s']:.0f} | "
            f"{r['schema_tokens_per_s'] / r['plain_tokens_per_s']:.2f}x | {r['schema_tokens_per_step']:.2f} | "
            f"{r['schema_no_forced_tokens_per_step']:.2f} |"
        )
    return "\n".join(lines)


@drawing
def plot(report: dict, path: Path) -> None:
    rows = report["rows"]
    labels = [f"{r['method']}\nbatch {r['batch']}" for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    grouped_bars(left, labels, {"unconstrained": [r["plain_tokens_per_s"] for r in rows],
                                "JSON schema": [r["schema_tokens_per_s"] for r in rows]})
    left.set_title("tokens/s")
    left.legend()
    grouped_bars(right, labels, {"schema, no forced drafts": [r["schema_no_forced_tokens_per_step"] for r in rows],
                                 "schema, forced drafts": [r["schema_tokens_per_step"] for r in rows]})
    right.set_title("tokens per step")
    right.legend()
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench-out/structured-output"))
    args = parser.parse_args()
    tokenizer = Tokenizer(DEFAULT_MODEL_DIR)
    rows = [measure(method, width, args, tokenizer) for method in METHODS for width in BATCHES]
    table = markdown_table(rows)
    print(table)
    save_report(args.out, "structured-output", {"schema": SCHEMA, "requests": args.requests,
                                                 "max_tokens": args.max_tokens, "rounds": args.rounds, "rows": rows},
                table, plot)


if __name__ == "__main__":
    sys.exit(main())
