"""Tokens/s and mean acceptance length, naive vs ngram, at 1 and 8 concurrent streams: in-process on the
engine, then through the whole mesh, so the mesh's own cost shows as a ratio.

    python -m benchmarks.speculation [--model DIR] [--max-tokens 128] [--out bench-out/speculation.json]

Prompts are the openings of held-out standard-library files (the demo model never trained on them). All
requests are greedy, so naive and ngram must emit identical tokens: the benchmark checks that too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import openai

from shared.config import DEFAULT_MODEL_DIR, EngineConfig, SpeculativeConfig
from shared.schemas import SamplingParams, WorkRequest
from shared.tokenizer import Tokenizer
from services.mesh_process import start_mesh
from services.worker.demo_model.data import load_corpus
from services.worker.engine import Engine

METHODS = {"naive": '{"method": "naive"}', "ngram": '{"method": "ngram", "num_speculative_tokens": 3}'}
CONCURRENCY = (1, 8)
PROMPT_TOKENS = 96


def prompts(tokenizer: Tokenizer, count: int) -> list[list[int]]:
    texts = [t for t in load_corpus().held_out if len(t) > 2000][:count]
    return [tokenizer.encode(t)[:PROMPT_TOKENS] for t in texts]


def run_engine(model: Path, method: str, batch: int, prompt_ids: list[list[int]], max_tokens: int) -> dict:
    engine = Engine(
        EngineConfig(model=model, max_num_seqs=batch, speculative=SpeculativeConfig.from_json(METHODS[method]))
    )
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs: dict[str, list[int]] = {}
    started = time.perf_counter()
    for i, ids in enumerate(prompt_ids):
        outputs[f"{i:032x}"] = []
        engine.add_request(WorkRequest(request_id=f"{i:032x}", prompt_token_ids=ids, sampling=sampling, created=0))
    while engine.has_work():
        for out in engine.step():
            outputs[out.seq.request_id] += out.tokens
    elapsed = time.perf_counter() - started
    tokens = sum(len(t) for t in outputs.values())
    return {
        "tokens_per_s": tokens / elapsed,
        "mean_acceptance_length": engine.stats.mean_acceptance_length,
        "outputs": [outputs[k] for k in sorted(outputs)],
    }


async def _mesh_requests(base_url: str, model: str, prompt_ids: list[list[int]], batch: int, max_tokens: int):
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    limit = asyncio.Semaphore(batch)

    async def one(ids: list[int]) -> int:
        async with limit:
            r = await client.completions.create(
                model=model, prompt=ids, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True}
            )
            return r.usage.completion_tokens

    started = time.perf_counter()
    counts = await asyncio.gather(*(one(ids) for ids in prompt_ids))
    await client.close()
    return sum(counts) / (time.perf_counter() - started)


def run_mesh(model: Path, method: str, batch: int, prompt_ids: list[list[int]], max_tokens: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        mesh = start_mesh(
            Path(tmp), "--speculative-config", METHODS[method], "--max-num-seqs", str(batch), model=model
        )
        try:
            asyncio.run(_mesh_requests(mesh.base_url, mesh.model, prompt_ids[:1], 1, 4))  # warm-up
            return asyncio.run(_mesh_requests(mesh.base_url, mesh.model, prompt_ids, batch, max_tokens))
        finally:
            mesh.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("bench-out/speculation.json"))
    args = parser.parse_args()
    prompt_ids = prompts(Tokenizer(args.model), 8)
    rows = []
    reference: dict[int, list] = {}
    for batch in CONCURRENCY:
        batch_prompts = prompt_ids[: max(batch, 2)]
        for method in METHODS:
            engine = run_engine(args.model, method, batch, batch_prompts, args.max_tokens)
            reference.setdefault(batch, engine["outputs"])
            if engine["outputs"] != reference[batch]:
                raise SystemExit(f"{method} at batch {batch} changed the greedy output")
            mesh_tps = run_mesh(args.model, method, batch, batch_prompts, args.max_tokens)
            rows.append(
                {
                    "method": method,
                    "concurrency": batch,
                    "engine_tokens_per_s": round(engine["tokens_per_s"], 1),
                    "mesh_tokens_per_s": round(mesh_tps, 1),
                    "mesh_over_engine": round(mesh_tps / engine["tokens_per_s"], 3),
                    "mean_acceptance_length": round(engine["mean_acceptance_length"], 3),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    header = "| method | streams | engine tok/s | mesh tok/s | mesh / engine | mean acceptance length |"
    print("\n" + header + "\n|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['method']} | {r['concurrency']} | {r['engine_tokens_per_s']} | {r['mesh_tokens_per_s']} "
            f"| {r['mesh_over_engine']} | {r['mean_acceptance_length']} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"max_tokens": args.max_tokens, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
