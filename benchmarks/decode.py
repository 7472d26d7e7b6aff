"""Batch-1 greedy decoding in-process, against transformers `generate` on the same checkpoint and prompts:

- context sweep: decode ms/step and tokens/s of specmesh naive and transformers greedy at each prompt length;
- self-repeating prompt (two import lines written over and over, whose greedy continuation keeps repeating
  them): specmesh ngram k=3 against transformers prompt lookup k=3 and greedy, and specmesh naive.

    python -m benchmarks.decode [--device cpu|cuda] [--shape NAME] [--dtype bfloat16] [--contexts 64 512 2048]
        [--max-tokens 128] [--out bench-out/decode]

Decode rate excludes the prefill: specmesh's clock starts after the step that sampled the first token;
transformers' decode time is generate(N tokens) minus generate(1 token). Each figure is the median of --repeats
runs, each system's runs interleaved with the others'. Every specmesh run's tokens must equal transformers'
greedy tokens (exit status 1 otherwise).
--shape runs a real-size shape with random weights (benchmarks/shape.py): prompts are random token ids, the
self-repeating prompt one random line of ids written sixteen times (random weights do not continue it, so there
ngram only shows what failed drafts cost).
Writes decode.json and decode.png to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import transformers

from benchmarks import shape
from shared.config import DEFAULT_MODEL_DIR, EngineConfig, SpeculativeConfig
from shared.schemas import SamplingParams, WorkRequest
from shared.tokenizer import Tokenizer
from services.worker.demo_model.data import load_corpus
from services.worker.engine.engine import Engine

CONTEXTS = (64, 512, 2048)
SELF_REPEATING_TEXT = "import os\nimport sys\n" * 16
SELF_REPEATING_TIMES, SELF_REPEATING_LINE_TOKENS = 16, 8  # --shape: a random line of ids, repeated
LOOKUP_TOKENS = 3  # transformers' prompt_lookup_num_tokens, the same k as ngram's
DEFAULT_MAX_TOKENS = 128
DEFAULT_REPEATS = 3
NAIVE = {"method": "naive"}
NGRAM = {"method": "ngram", "num_speculative_tokens": LOOKUP_TOKENS}
NAIVE_NAME, NGRAM_NAME = "naive", f"ngram k={LOOKUP_TOKENS}"
GREEDY_NAME, LOOKUP_NAME = "transformers greedy", f"transformers prompt lookup k={LOOKUP_TOKENS}"


def held_out_tokens(tokenizer: Tokenizer, count: int) -> list[int]:
    """BOS and then count - 1 tokens of held-out standard-library text (files joined in order)."""
    ids: list[int] = []
    for text in load_corpus().held_out:
        ids += tokenizer.encode(text)
        if len(ids) >= count:
            break
    return ids[:1] + ids[1:count]


def engine_decode(engine: Engine, prompt: list[int], max_tokens: int) -> tuple[list[int], float, int]:
    """(tokens, decode seconds after the first token, decode steps) of one greedy request alone."""
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request(WorkRequest(request_id=f"{time.perf_counter_ns():032x}", prompt_token_ids=prompt,
                                   sampling=sampling, created=0))
    tokens = [t for out in engine.step() for t in out.tokens]
    started, steps = time.perf_counter(), 0
    while engine.has_work():
        tokens += [t for out in engine.step() for t in out.tokens]
        steps += 1
    return tokens, time.perf_counter() - started, steps


def hf_generate(model, prompt: list[int], max_tokens: int, lookup: int | None) -> tuple[list[int], float]:
    bos = model.config.bos_token_id
    config = transformers.GenerationConfig(
        do_sample=False, max_new_tokens=max_tokens, eos_token_id=None, bos_token_id=bos, pad_token_id=bos,
        prompt_lookup_num_tokens=lookup,
    )
    ids = torch.tensor([prompt], device=model.device)
    _sync(model.device)
    started = time.perf_counter()
    # An explicit mask: the prompt starts with BOS, which is also the pad id transformers would mask out.
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    _sync(model.device)
    return out[0, len(prompt) :].tolist(), time.perf_counter() - started


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_decode(model, prompt: list[int], max_tokens: int, lookup: int | None) -> tuple[list[int], float, int]:
    """(tokens, decode seconds after the first token, decode steps: one a token for greedy, None for prompt
    lookup, whose steps transformers does not report)."""
    tokens, whole = hf_generate(model, prompt, max_tokens, lookup)
    return tokens, whole - hf_generate(model, prompt, 1, None)[1], len(tokens) - 1 if lookup is None else None


def interleaved(contenders: dict[str, Callable[[], tuple]], repeats: int) -> dict[str, tuple[list[int], float, int]]:
    """Each contender's (tokens, median seconds, steps), its runs interleaved with the others' (A B C A B C ...),
    so a machine whose speed drifts during the run moves every contender alike."""
    runs: dict[str, list[tuple]] = {name: [] for name in contenders}
    for _ in range(repeats):
        for name, contender in contenders.items():
            runs[name].append(contender())
    return {name: (r[0][0], statistics.median(x[1] for x in r), r[0][2]) for name, r in runs.items()}


def measure(args: argparse.Namespace) -> dict:
    model_dir, load_format = shape.model_source(args)
    model = shape.transformers_model(model_dir, load_format, shape.DTYPES[args.dtype], args.device)
    tokenizer = Tokenizer(model_dir) if load_format == "auto" else None
    bos, vocab_size = model.config.bos_token_id, model.config.vocab_size

    def context_prompt(count: int) -> list[int]:
        return held_out_tokens(tokenizer, count) if tokenizer else [bos] + shape.random_prompt(vocab_size, count - 1)

    if tokenizer:
        prompt = [bos] + tokenizer.encode(SELF_REPEATING_TEXT)
    else:
        prompt = [bos] + shape.random_prompt(vocab_size, SELF_REPEATING_LINE_TOKENS) * SELF_REPEATING_TIMES
    max_len = max(*args.contexts, len(prompt)) + args.max_tokens + 16
    engines = {
        name: Engine(EngineConfig(model=model_dir, device=args.device, max_num_seqs=1, max_model_len=max_len,
                                  dtype=args.dtype, load_format=load_format,
                                  speculative=SpeculativeConfig.model_validate(spec)))
        for name, spec in ((NAIVE_NAME, NAIVE), (NGRAM_NAME, NGRAM))
    }
    rows, mismatches = [], []

    def case_rows(case: str, prompt: list[int], systems: list[str], context: int | None = None) -> None:
        contenders = {GREEDY_NAME: lambda: hf_decode(model, prompt, args.max_tokens, None)}
        if LOOKUP_NAME in systems:
            contenders[LOOKUP_NAME] = lambda: hf_decode(model, prompt, args.max_tokens, LOOKUP_TOKENS)
        for name in engines:
            if f"specmesh {name}" in systems:
                contenders[f"specmesh {name}"] = partial(engine_decode, engines[name], prompt, args.max_tokens)
        results = interleaved(contenders, args.repeats)
        reference = results[GREEDY_NAME][0]
        for system, (tokens, seconds, steps) in results.items():
            if tokens != reference and system.startswith("specmesh"):
                mismatches.append(f"{system} on {case}")
            rows.append({
                "case": case, "context": context, "system": system,
                "ms_per_step": None if steps is None else 1e3 * seconds / steps,
                "tokens_per_s": (len(tokens) - 1) / seconds, "same_tokens": tokens == reference,
            })

    with torch.inference_mode():
        warm = context_prompt(16)
        engine_decode(engines[NAIVE_NAME], warm, 8)
        hf_generate(model, warm, 8, None)
        for context in args.contexts:
            case_rows(f"context {context}", context_prompt(context), [f"specmesh {NAIVE_NAME}"], context)
        case_rows(f"self-repeating prompt ({len(prompt)} tokens)", prompt,
                  [LOOKUP_NAME, f"specmesh {NAIVE_NAME}", f"specmesh {NGRAM_NAME}"])
    return {"model": str(model_dir), "load_format": load_format, "dtype": args.dtype, "device": args.device,
            "max_tokens": args.max_tokens, "repeats": args.repeats,
            "torch_threads": torch.get_num_threads(), "torch_version": torch.__version__,
            "transformers_version": transformers.__version__, "rows": rows, "mismatches": mismatches}


def plot_decode(report: dict, path: Path) -> None:
    """Left: decode ms/step by context length, specmesh naive against transformers; right: tokens/s on the
    self-repeating prompt."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    sweep = [r for r in report["rows"] if r.get("context")]
    for system in dict.fromkeys(r["system"] for r in sweep):
        points = [(r["context"], r["ms_per_step"]) for r in sweep if r["system"] == system]
        left.plot(*zip(*points), marker="o", label=system)
    left.set(xscale="log", xlabel="context (tokens)", ylabel="decode ms/step (lower is better)",
             title=f"batch 1, greedy, {report['device']}")
    left.legend()
    repeat = [r for r in report["rows"] if not r.get("context")]
    right.barh([r["system"] for r in repeat], [r["tokens_per_s"] for r in repeat])
    right.set(xlabel="tokens/s (higher is better)", title=repeat[0]["case"] if repeat else "")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(report: dict) -> str:
    lines = ["| case | system | ms/step | tokens/s | same tokens |", "|---|---|---:|---:|---|"]
    for r in report["rows"]:
        ms = "–" if r["ms_per_step"] is None else f"{r['ms_per_step']:.2f}"
        lines.append(f"| {r['case']} | {r['system']} | {ms} | {r['tokens_per_s']:.1f} | "
                     f"{'yes' if r['same_tokens'] else 'NO'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    shape.add_arguments(parser)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS)
    parser.add_argument("--out", type=Path, default=Path("bench-out/decode"))
    args = parser.parse_args()
    report = measure(args)
    text = table(report)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "table.md").write_text(text + "\n")
    plot_decode(report, args.out / "decode.png")
    print(f"wrote {args.out / 'decode.json'}, {args.out / 'decode.png'}")
    if report["mismatches"]:
        print("MISMATCH: " + "; ".join(report["mismatches"]))
        sys.exit(1)


if __name__ == "__main__":
    main()
