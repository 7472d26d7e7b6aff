"""Every drafting method on the demo model: tokens/s, acceptance length, acceptance rate and acceptance by draft
position, for batch 1, 8, 32 at temperature 0 and 1, next to transformers' `generate` (greedy, and greedy with
prompt lookup) on the same checkpoint and prompts.

    python -m benchmarks.methods [--device cpu|cuda] [--model DIR | --shape NAME] [--dtype bfloat16]
        [--max-tokens 96] [--prompts 2] [--batches 1 8 32] [--methods NAME ...] [--adaptive-batches 32]
        [--reference-prompts N] [--out bench-out/methods]

Each engine run is in-process: all requests are submitted at once with max_num_seqs = batch and the engine is
stepped until done; tokens/s = emitted tokens / that wall time (prefill included). A run has max(batch, --prompts)
prompts: the BOS token then a window of a held-out standard-library file the demo model never trained on.
Speedups are over specmesh naive at the same batch and temperature (transformers rows: naive at batch 1, T=0).
transformers runs one prompt at a time over the largest prompt set (its first --reference-prompts only, if
given). Every specmesh method at temperature 0 must reproduce transformers' greedy tokens exactly on the prompts
transformers ran (one OK/MISMATCH line per method; exit status 1 on any mismatch); transformers' own
prompt-lookup output is compared too, for information only. ms per step = an engine run's wall time over its
steps (prefill steps included). --methods picks some of the methods (adaptive ones by name too), which run
adaptively at --adaptive-batches.
--shape runs a real-size shape with random weights (benchmarks/shape.py) on random-id prompts; it has no MTP
module, so the MTP methods are left out, and with random weights only naive's speed means anything.

Writes methods.json (every figure), methods.png (benchmarks/plot.py) and table.md (the printed table) to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import transformers

from benchmarks import shape
from shared.config import DEFAULT_MODEL_DIR, EngineConfig, SpeculativeConfig
from shared.schemas import SamplingParams, WorkRequest
from shared.tokenizer import Tokenizer
from services.worker.demo_model.data import load_corpus
from services.worker.engine.engine import Engine, EngineStats
from services.worker.model.config import ModelConfig
from benchmarks.plot import plot
from services.worker.drafting.checkpoints import default_draft_dir, default_eagle3_dir

METHODS: dict[str, dict] = {
    "naive": {"method": "naive"},
    "ngram k=3": {"method": "ngram", "num_speculative_tokens": 3},
    "suffix k=3": {"method": "suffix", "num_speculative_tokens": 3},
    "mtp k=1": {"method": "mtp", "num_speculative_tokens": 1, "num_model_steps": 1},
    # The demo model has one MTP module: three model steps feed it its own hidden state twice.
    "mtp k=3 steps=3": {"method": "mtp", "num_speculative_tokens": 3, "num_model_steps": 3},
    "mtp+ngram k=3": {"method": "mtp", "num_speculative_tokens": 3, "num_model_steps": 1, "mtp_strategy": "with_ngram"},
    # The draft model shipped beside the demo model (models/specmesh-demo-draft)
    "draft_model k=3": {"method": "draft_model", "num_speculative_tokens": 3},
    # The EAGLE-3 head shipped beside the demo model (models/specmesh-demo-eagle3)
    "eagle3 k=3": {"method": "eagle3", "num_speculative_tokens": 3},
}
# Adaptive speculation matters when the worker is busy, so by default it runs at the largest batch only.
ADAPTIVE_METHODS: dict[str, dict] = {
    "ngram k=3 adaptive": {**METHODS["ngram k=3"], "adaptive": True},
    "mtp k=3 steps=3 adaptive": {**METHODS["mtp k=3 steps=3"], "adaptive": True},
}
BASELINE = "naive"
BATCHES = (1, 8, 32)
ADAPTIVE_BATCH = 32
TEMPERATURES = (0.0, 1.0)
GREEDY = 0.0
DEFAULT_MAX_TOKENS = 96
DEFAULT_PROMPT_TOKENS = 64
MIN_PROMPTS = 2  # even batch 1 serves two requests, one after the other
LOOKUP_TOKENS = 3  # transformers' prompt_lookup_num_tokens, the same k as the specmesh methods
WARMUP_TOKENS = 4
MS_PER_S = 1e3


@dataclass
class Run:
    method: str
    batch: int
    temperature: float
    num_prompts: int
    tokens: int
    seconds: float
    tokens_per_s: float
    steps: int | None = None  # engine steps of the run; None: transformers
    mean_acceptance_length: float | None = None  # None: the method drafts nothing
    acceptance_rate: float | None = None
    drafted_at: list[int] = field(default_factory=list)  # draft tokens proposed at position j of a step
    accepted_at: list[int] = field(default_factory=list)
    speedup: float | None = None  # over naive at the same batch and temperature
    outputs: list[list[int]] = field(default_factory=list, repr=False)

    @property
    def per_position(self) -> list[float | None]:
        """accepted / drafted at each draft position; None where no step drafted that far."""
        return [a / d if d else None for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def ms_per_step(self) -> float | None:
        return MS_PER_S * self.seconds / self.steps if self.steps else None

    def figures(self) -> dict:
        return {**{k: v for k, v in asdict(self).items() if k != "outputs"}, "per_position": self.per_position,
                "ms_per_step": self.ms_per_step}


def load_prompts(tokenizer: Tokenizer, count: int, prompt_tokens: int) -> list[list[int]]:
    """count prompts of prompt_tokens tokens: BOS, then window w of held-out file f (prompt i = f + w * files)."""
    body = prompt_tokens - 1
    encoded = [tokenizer.encode(text) for text in load_corpus().held_out]
    for windows in range(1, count + 1):
        files = [ids for ids in encoded if len(ids) >= 1 + body * windows]
        if len(files) * windows >= count:
            break
    else:
        raise SystemExit(f"the held-out files are too short for {count} prompts of {prompt_tokens} tokens")
    chosen = [(files[i % len(files)], i // len(files)) for i in range(count)]
    return [ids[:1] + ids[1 + body * w : 1 + body * (w + 1)] for ids, w in chosen]


def run_engine(
    model: Path, name: str, spec: dict, batch: int, prompts: list[list[int]], max_tokens: int, temperature: float,
    device: str = "cpu", load_format: str = "auto", dtype: str = "float32",
) -> Run:
    config = SpeculativeConfig.model_validate(spec)
    engine = Engine(EngineConfig(model=model, max_num_seqs=batch, speculative=config, device=device,
                                 load_format=load_format, dtype=dtype))
    warm_up(engine, prompts[0], temperature)
    outputs: list[list[int]] = [[] for _ in prompts]
    drafted, accepted = [0] * config.num_drafts, [0] * config.num_drafts
    requests = [
        WorkRequest(
            request_id=f"{i:032x}", prompt_token_ids=ids, created=0,
            sampling=SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=i),
        )
        for i, ids in enumerate(prompts)
    ]
    with torch.inference_mode():
        started = time.perf_counter()
        for request in requests:
            engine.add_request(request)
        while engine.has_work():
            for out in engine.step():
                outputs[int(out.seq.request_id, 16)] += out.tokens
                for j in range(len(out.draft_tokens)):
                    drafted[j] += 1
                    accepted[j] += j < out.num_accepted
        seconds = time.perf_counter() - started
    stats = engine.stats
    tokens = sum(map(len, outputs))
    drafts = stats.num_drafts > 0
    return Run(
        name, batch, temperature, len(prompts), tokens, seconds, tokens / seconds, steps=stats.num_steps,
        mean_acceptance_length=stats.mean_acceptance_length if drafts else None,
        acceptance_rate=stats.num_accepted_tokens / stats.num_draft_tokens if drafts else None,
        drafted_at=drafted, accepted_at=accepted, outputs=outputs,
    )


def warm_up(engine: Engine, prompt: list[int], temperature: float) -> None:
    """A few steps before the clock starts, so that lazy initialisation (Triton compiling a kernel for this
    configuration on first use) is not timed; the engine's counters are reset after."""
    sampling = SamplingParams(temperature=temperature, max_tokens=WARMUP_TOKENS, ignore_eos=True, seed=0)
    engine.add_request(WorkRequest(request_id=f"{0:032x}", prompt_token_ids=prompt, created=0, sampling=sampling))
    while engine.has_work():
        engine.step()
    engine.stats = EngineStats()


def run_transformers(
    model: transformers.PreTrainedModel, name: str, prompts: list[list[int]], max_tokens: int, lookup: int | None
) -> Run:
    """Greedy generate, one prompt at a time; EOS does not stop it, as ignore_eos in the engine runs."""
    bos = model.config.bos_token_id
    generation = transformers.GenerationConfig(
        do_sample=False, max_new_tokens=max_tokens, eos_token_id=None, bos_token_id=bos, pad_token_id=bos,
        prompt_lookup_num_tokens=lookup,
    )
    outputs = []
    with torch.inference_mode():
        started = time.perf_counter()
        for prompt in prompts:
            ids = torch.tensor([prompt], device=model.device)
            # An explicit mask: the prompt starts with BOS, which is also the pad id transformers would mask out.
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=generation)
            outputs.append(out[0, len(prompt) :].tolist())
        seconds = time.perf_counter() - started
    if any(len(o) != max_tokens for o in outputs):
        raise SystemExit(f"{name} stopped before {max_tokens} tokens: EOS was not disabled")
    tokens = sum(map(len, outputs))
    return Run(name, 1, GREEDY, len(prompts), tokens, seconds, tokens / seconds, outputs=outputs)


def first_difference(output: list[int], reference: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(output, reference)) if a != b), min(len(output), len(reference)))


def check_greedy(runs: list[Run], reference: list[list[int]]) -> dict[str, str]:
    """Per method, OK or where its greedy tokens first left transformers' (batch, prompt, token index)."""
    verdicts: dict[str, str] = {}
    for run in runs:
        if run.temperature != GREEDY:
            continue
        # zip: a reference over the first prompts only checks those
        bad = [(p, first_difference(o, r)) for p, (o, r) in enumerate(zip(run.outputs, reference)) if o != r]
        problems = [f"batch {run.batch} prompt {p} from token {i}" for p, i in bad]
        previous = verdicts.get(run.method, "OK")
        if problems:
            verdicts[run.method] = "; ".join(([] if previous == "OK" else [previous]) + problems)
        else:
            verdicts.setdefault(run.method, "OK")
    return verdicts


def _verdict_line(verdict: str) -> str:
    return verdict if verdict == "OK" else f"MISMATCH ({verdict})"


def _fmt(value: float | None, digits: int = 2, unit: str = "") -> str:
    return "–" if value is None else f"{value:.{digits}f}{unit}"


def markdown_table(runs: list[Run]) -> str:
    lines = [
        "| method | batch | temperature | tokens/s | speedup over naive | mean acceptance length "
        "| acceptance rate | acceptance by position |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in runs:
        by_position = " / ".join(_fmt(p) for p in r.per_position) or "–"
        lines.append(
            f"| {r.method} | {r.batch} | {r.temperature:g} | {r.tokens_per_s:.1f} | {_fmt(r.speedup, unit='×')} "
            f"| {_fmt(r.mean_acceptance_length)} | {_fmt(r.acceptance_rate)} | {by_position} |"
        )
    return "\n".join(lines)


def _set_speedups(runs: list[Run]) -> None:
    naive = {(r.batch, r.temperature): r.tokens_per_s for r in runs if r.method == BASELINE}
    for r in runs:
        if (r.batch, r.temperature) in naive:
            r.speedup = r.tokens_per_s / naive[(r.batch, r.temperature)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    shape.add_arguments(parser)
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    parser.add_argument("--prompts", type=int, default=MIN_PROMPTS, help="prompts per run at least (default 2)")
    parser.add_argument("--prompt-tokens", type=int, default=DEFAULT_PROMPT_TOKENS)
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--methods", nargs="+", choices=[*METHODS, *ADAPTIVE_METHODS],
                        default=[*METHODS, *ADAPTIVE_METHODS], help="the methods to run (default: all)")
    parser.add_argument("--adaptive-batches", type=int, nargs="+", default=[ADAPTIVE_BATCH],
                        help="batches the adaptive methods run at")
    parser.add_argument("--reference-prompts", type=int, default=None,
                        help="transformers runs only the first N prompts, and the greedy check compares those")
    parser.add_argument("--out", type=Path, default=Path("bench-out/methods"))
    parser.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU machine")
    args = parser.parse_args()
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)

    counts = {b: max(b, args.prompts) for b in args.batches}
    model_dir, load_format = shape.model_source(args)
    hf_model = shape.transformers_model(model_dir, load_format, shape.DTYPES[args.dtype], args.device)
    if load_format == "auto":
        prompts = load_prompts(Tokenizer(model_dir), max(counts.values()), args.prompt_tokens)
    else:
        bos, vocab_size = hf_model.config.bos_token_id, hf_model.config.vocab_size
        prompts = [[bos] + shape.random_prompt(vocab_size, args.prompt_tokens - 1, seed=i)
                   for i in range(max(counts.values()))]
    has_mtp = ModelConfig.from_dir(model_dir).num_mtp_layers > 0
    engine_args = dict(device=args.device, load_format=load_format, dtype=args.dtype)
    run_transformers(hf_model, "warm-up", prompts[:1], WARMUP_TOKENS, None)
    run_engine(model_dir, "warm-up", METHODS[BASELINE], 1, prompts[:1], WARMUP_TOKENS, GREEDY, **engine_args)

    reference_prompts = prompts[: args.reference_prompts]
    greedy = run_transformers(hf_model, "transformers greedy", reference_prompts, args.max_tokens, None)
    lookup = run_transformers(
        hf_model, f"transformers prompt lookup k={LOOKUP_TOKENS}", reference_prompts, args.max_tokens, LOOKUP_TOKENS
    )
    reference_runs = [greedy, lookup]
    for r in reference_runs:
        print(json.dumps(r.figures()), flush=True)

    runs: list[Run] = []
    for temperature in TEMPERATURES:
        for batch in args.batches:
            methods = {**METHODS, **(ADAPTIVE_METHODS if batch in args.adaptive_batches else {})}
            for name, spec in methods.items():
                if name not in args.methods or (spec["method"] == "mtp" and not has_mtp):
                    continue
                if spec["method"] == "draft_model" and not default_draft_dir(model_dir).is_dir():
                    continue  # no draft model beside this one
                if spec["method"] == "eagle3" and not default_eagle3_dir(model_dir).is_dir():
                    continue  # no EAGLE-3 head beside this one
                run = run_engine(
                    model_dir, name, spec, batch, prompts[: counts[batch]], args.max_tokens, temperature, **engine_args
                )
                runs.append(run)
                print(json.dumps(run.figures()), flush=True)
    _set_speedups(runs)

    # Against transformers at batch 1, the reference is specmesh naive at batch 1 and temperature 0.
    naive_single = next((r for r in runs if (r.method, r.batch, r.temperature) == (BASELINE, 1, GREEDY)), None)
    for r in reference_runs:
        r.speedup = r.tokens_per_s / naive_single.tokens_per_s if naive_single else None

    verdicts = check_greedy(runs, greedy.outputs)
    lookup_verdict = check_greedy([lookup], greedy.outputs)[lookup.method]
    table = markdown_table(runs + reference_runs)
    print("\n" + table + "\n")
    for method, verdict in verdicts.items():
        print(f"greedy check {method}: {_verdict_line(verdict)}")
    print(f"greedy check (information only) {lookup.method}: {_verdict_line(lookup_verdict)}")

    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "model": str(model_dir),
        "load_format": load_format,
        "dtype": args.dtype,
        "device": args.device,
        "max_tokens": args.max_tokens,
        "prompt_tokens": args.prompt_tokens,
        "torch_threads": threads,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "runs": [r.figures() for r in runs],
        "transformers": [r.figures() for r in reference_runs],
        "greedy_check": verdicts,
        "transformers_prompt_lookup_check": lookup_verdict,
    }
    (args.out / "methods.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "table.md").write_text(table + "\n")
    plot(report, args.out / "methods.png")
    print(f"wrote {args.out / 'methods.json'}, {args.out / 'methods.png'}, {args.out / 'table.md'}")
    if any(v != "OK" for v in verdicts.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
