"""`specmesh up` on its defaults against transformers `generate`, on code neither the demo model nor its drafters
ever saw: the Python files of an installed package (default aiohttp; the demo model trained on the standard
library only, and no drafter was tuned on anything).

    python -m benchmarks.heldout [--package aiohttp] [--requests 6] [--rounds 5] [--max-tokens 128]
        [--cases plain-64 plain-2k speculation] [--speculative-config JSON] [--up-options "..."]
        [--out bench-out/heldout]

Cases, one greedy request at a time (`ignore_eos`), each prompt the opening of one of the package's files:
- plain decoding at a 64-token and a 1,900-token context: requests ask for no drafts
  (`"speculative": {"num_speculative_tokens": 0}`), against transformers greedy;
- the default speculation (whatever `specmesh up` drafts with when asked nothing; --speculative-config gives the
  mesh another) on 256-token prompts, against transformers greedy, transformers prompt lookup with the same k, and
  plain decoding through the same mesh.
Within a case, every round serves prompts from files no earlier round used (and the warm-up request one more):
suffix decoding remembers recent requests' outputs, and a prompt served twice would measure that memory, not
held-out text. Cases take openings of the same files, so measure suffix decoding with `--cases speculation` alone.
The mesh is one `specmesh up` with no options (--up-options adds some, for experiments), driven by
benchmarks/mesh_client.py's SSE client; its decode rate is the tokens after each request's first chunk over the time
from its first chunk to its last, summed over the requests. transformers runs in this process as a user runs it:
torch's default threads, on any CPU, while the mesh idles; its decode time is generate(N) minus generate(1)
(benchmarks/decode.py). Mesh and transformers passes take turns (--rounds), each figure the median of its passes.
The mesh's greedy text must equal transformers' (exit status 1 otherwise). Writes heldout.json, heldout.png and
table.md to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

import aiohttp
import torch

from benchmarks import shape
from benchmarks.decode import hf_decode
from benchmarks.mesh_client import HTTP_TIMEOUT_S, Stream, first_chunk_tokens, stream_completion, token_ends
from benchmarks.plot import plot_heldout, save_report
from services.detokenizer.incremental import TokenTable
from services.mesh_process import start_mesh
from shared.config import DEFAULT_MODEL_DIR, SpeculativeConfig
from shared.tokenizer import Tokenizer

PACKAGE = "aiohttp"
PLAIN = {"num_speculative_tokens": 0}
CASES = {  # option: (name, prompt tokens, the request's `speculative` object, whether it is the speculation case)
    "plain-64": ("plain, 64-token context", 64, PLAIN, False),
    "plain-2k": ("plain, 1,900-token context", 1900, PLAIN, False),
    "speculation": ("default speculation, 256-token prompts", 256, None, True),
}
REQUESTS, ROUNDS, MAX_TOKENS = 6, 5, 128


def package_prompts(tokenizer: Tokenizer, package: str, count: int, prompt_tokens: int) -> list[list[int]]:
    """BOS and the first prompt_tokens - 1 tokens of each of the package's longest-enough .py files, in path order."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"{package} is not an installed package")
    root = Path(next(iter(spec.submodule_search_locations)))
    prompts = []
    for path in sorted(root.rglob("*.py")):
        ids = tokenizer.encode(path.read_text(encoding="utf-8", errors="replace"))
        if len(ids) >= prompt_tokens:
            prompts.append(ids[:prompt_tokens])
        if len(prompts) == count:
            return prompts
    raise SystemExit(f"{package} has fewer than {count} files of {prompt_tokens} tokens")


def text_prompts(tokenizer: Tokenizer, path: Path, count: int, prompt_tokens: int) -> list[list[int]]:
    """count windows of prompt_tokens tokens from the text file at path (prose a code model never saw, such as the
    Shakespeare aiperf's synthetic prompts sample from), at evenly spaced offsets: the same prompts every run."""
    ids = tokenizer.encode(path.read_text(encoding="utf-8", errors="replace"))
    span = len(ids) - prompt_tokens
    if span < count:
        raise SystemExit(f"{path} has too few tokens for {count} windows of {prompt_tokens}")
    return [ids[i * span // count : i * span // count + prompt_tokens] for i in range(count)]


async def mesh_pass(base_url: str, model: str, prompts: list[list[int]], speculative: dict | None,
                    max_tokens: int) -> list[Stream]:
    timeout = aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        streams = []
        for ids in prompts:
            body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                    "ignore_eos": True}
            if speculative is not None:
                body["speculative"] = speculative
            streams.append(await stream_completion(session, f"{base_url}/completions", body))
        return streams


def mesh_decode_rate(streams: list[Stream], ends: list[list[int]]) -> float:
    """Tokens after each request's first chunk over its first-to-last chunk time, summed over the requests."""
    tokens = sum(len(e) - first_chunk_tokens(s, e) for s, e in zip(streams, ends))
    seconds = sum(s.arrivals[-1][0] - s.arrivals[0][0] for s in streams)
    return tokens / seconds


def transformers_rate(model, prompts: list[list[int]], max_tokens: int, lookup: int | None
                      ) -> tuple[float, list[list[int]]]:
    runs = [hf_decode(model, ids, max_tokens, lookup) for ids in prompts]
    return sum(len(t) - 1 for t, _, _ in runs) / sum(s for _, s, _ in runs), [t for t, _, _ in runs]


def run_case(args: argparse.Namespace, mesh, hf_model, table: TokenTable, name: str, prompts: list[list[int]],
             speculative: dict | None, lookup: int | None) -> tuple[dict, list[str]]:
    """Mesh and transformers passes in turns; the case's figures and where the mesh's text differed."""
    figures: dict[str, list[float]] = {"mesh": [], "transformers greedy": []}
    if lookup is not None:
        figures.update({f"transformers prompt lookup k={lookup}": [], "mesh, no drafts": []})
    mismatches: list[str] = []
    warm_up, *rounds = prompts
    asyncio.run(mesh_pass(mesh.base_url, mesh.model, [warm_up], speculative, args.max_tokens))
    for round_number in range(args.rounds):
        prompts = rounds[round_number * args.requests:(round_number + 1) * args.requests]
        rate, expected = transformers_rate(hf_model, prompts, args.max_tokens, None)
        figures["transformers greedy"].append(rate)
        texts_ends = [token_ends(table, tokens) for tokens in expected]
        for label, request in (("mesh", speculative), ("mesh, no drafts", PLAIN)):
            if label not in figures:
                continue
            streams = asyncio.run(mesh_pass(mesh.base_url, mesh.model, prompts, request, args.max_tokens))
            mismatches += [f"{name}, {label}, request {i}" for i, (s, (text, _)) in
                           enumerate(zip(streams, texts_ends)) if s.text != text]
            figures[label].append(mesh_decode_rate(streams, [e for _, e in texts_ends]))
        if lookup is not None:
            rate, _ = transformers_rate(hf_model, prompts, args.max_tokens, lookup)
            figures[f"transformers prompt lookup k={lookup}"].append(rate)
    row = {"case": name, "prompt_tokens": len(warm_up), "requests": len(rounds), "speculative": speculative,
           "decode_tokens_per_s": {k: statistics.median(v) for k, v in figures.items()}, "passes": figures}
    rates = row["decode_tokens_per_s"]
    row["ratios"] = {f"mesh / {k}": rates["mesh"] / v for k, v in rates.items() if k != "mesh"}
    print(json.dumps({k: row[k] for k in ("case", "decode_tokens_per_s", "ratios")}), flush=True)
    return row, mismatches


def markdown_table(rows: list[dict]) -> str:
    lines = ["| case | system | decode tok/s | mesh / system |", "|---|---|---:|---:|"]
    for row in rows:
        for system, rate in row["decode_tokens_per_s"].items():
            ratio = row["ratios"].get(f"mesh / {system}")
            lines.append(f"| {row['case']} | {system} | {rate:,.0f} | {'' if ratio is None else f'{ratio:.2f}x'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--package", default=PACKAGE, help="an installed package whose .py files give the prompts")
    parser.add_argument("--requests", type=int, default=REQUESTS, help="prompts per case")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--speculative-config", default=None, help="JSON for `specmesh up` (default: its own)")
    parser.add_argument("--up-options", default="", help="options for `specmesh up` (default: none)")
    parser.add_argument("--out", type=Path, default=Path("bench-out/heldout"))
    args = parser.parse_args()
    default = SpeculativeConfig.from_json(args.speculative_config)
    lookup = default.num_speculative_tokens
    up_options = shlex.split(args.up_options)
    if args.speculative_config:
        up_options += ["--speculative-config", args.speculative_config]
    if "--dtype" not in up_options:  # the reference below is float32; --dtype auto would be bfloat16 on CUDA
        up_options += ["--dtype", "float32"]
    tokenizer = Tokenizer(args.model)
    table = TokenTable.from_tokenizer(tokenizer)
    hf_model = shape.transformers_model(args.model, "auto", torch.float32, "cpu")
    rows, mismatches = [], []
    with tempfile.TemporaryDirectory() as tmp:
        mesh = start_mesh(Path(tmp), *up_options)
        mesh_cpu_plan = mesh.cpu_plan
        try:
            for name, prompt_tokens, speculative, speculating in (CASES[case] for case in args.cases):
                prompts = package_prompts(tokenizer, args.package, 1 + args.requests * args.rounds, prompt_tokens)
                row, bad = run_case(args, mesh, hf_model, table, name, prompts, speculative,
                                    lookup if speculating else None)
                rows.append(row)
                mismatches += bad
        finally:
            mesh.stop()
    text = markdown_table(rows)
    print("\n" + text + "\n")
    print("greedy check: " + ("OK" if not mismatches else "MISMATCH in " + "; ".join(mismatches)))
    report = {
        "model": str(args.model), "package": args.package, "max_tokens": args.max_tokens, "rounds": args.rounds,
        "mesh": shlex.join(["specmesh", "up", *up_options]), "mesh_cpu_plan": mesh_cpu_plan,
        "speculation": default.model_dump(include={"method", "num_speculative_tokens"}),
        "transformers_threads": torch.get_num_threads(), "cpus": len(os.sched_getaffinity(0)),
        "torch_version": torch.__version__, "rows": rows, "greedy_mismatches": mismatches,
    }
    save_report(args.out, "heldout", report, text, plot_heldout)
    if mismatches:
        sys.exit(1)


if __name__ == "__main__":
    main()
