"""Each Triton kernel against its torch twin on a GPU, over serving shapes: time, nominal GB/s, speedup, and
whether the two gave the same result.

    python -m benchmarks.kernels [--batches 1 8 64 256] [--vocabs 32000 151936] [--ks 1 3 5] [--reps 10]
        [--logprobs-batches 1 8 32 64] [--logprobs-top-k 0 20] [--only logprobs ...] [--out DIR]

GB/s is nominal: the bytes of the input tensors divided by the time. Verification reads only the rows a request
needs (it stops at the first rejection), so its figure can exceed what it really moved; logprobs reads each row
once more where a chunk may hold a top-K entry (at most top-k chunks of a row), so its figure slightly
understates it. Logprobs runs at Qwen2.5's 151,936-id vocabulary, one reported row per sequence (a decode step).
On a machine without CUDA it says so and exits. --out writes every row to kernels.json; the exit status is 1
when a kernel's result differs from its twin's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from services.worker.sampling.random import Purpose
from services.worker.sampling.rejection import PAD_TOKEN, VERIFY_STRATEGIES, VerifyInput

WARMUP = 3
LOGPROBS_VOCAB = 151936  # Qwen2.5's vocabulary
KERNELS = ("sample", "verify", "logprobs", "ngram")
NGRAM_CONTEXT = 4096
NGRAM_ALPHABET = 64  # a small alphabet, so suffixes recur as in code or structured output
NGRAM_MAX, NGRAM_MIN = 5, 2


def _milliseconds(fn: Callable[[], object], reps: int) -> float:
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) and a.dtype.is_floating_point:
        return torch.allclose(a, b, atol=1e-5, rtol=0)
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, tuple):
        return all(_same(x, y) for x, y in zip(a, b))
    return all(_same(getattr(a, f), getattr(b, f)) for f in ("num_accepted", "output_tokens", "offsets"))


def _report(
    name: str, shape: str, nbytes: int, kernel: Callable[[], object], twin: Callable[[], object], reps: int
) -> dict:
    kernel_ms, twin_ms = _milliseconds(kernel, reps), _milliseconds(twin, reps)
    same = _same(kernel(), twin())
    print(
        f"{name:<22} {shape:<28} kernel {kernel_ms:8.3f} ms {nbytes / kernel_ms / 1e6:8.1f} GB/s   "
        f"twin {twin_ms:8.3f} ms   speedup {twin_ms / kernel_ms:6.1f}x   same {'yes' if same else 'NO'}"
    )
    return {"kernel": name, "shape": shape, "kernel_ms": kernel_ms, "twin_ms": twin_ms,
            "gb_per_s": nbytes / kernel_ms / 1e6, "same": same}


def _probs(rows: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    return torch.softmax(3 * torch.randn(rows, vocab, device="cuda", generator=generator), dim=-1)


def bench_sampling(batches: list[int], vocabs: list[int], reps: int, generator: torch.Generator) -> list[dict]:
    from kernels.sampling import sample_launch
    from services.worker.sampling.sample import sample_torch

    rows = []
    for vocab in vocabs:
        for batch in batches:
            probs = _probs(batch, vocab, generator)
            seeds = torch.arange(batch, device="cuda")
            args = (probs, seeds, seeds, Purpose.SAMPLE)
            rows.append(_report("sample", f"N={batch} V={vocab}", probs.nbytes, lambda: sample_launch(*args),
                                lambda: sample_torch(*args), reps))  # fmt: skip
    return rows


def _verify_input(batch: int, k: int, vocab: int, generator: torch.Generator) -> VerifyInput:
    target = _probs(batch * (k + 1), vocab, generator).view(batch, k + 1, vocab)
    right = target[:, :k].argmax(dim=-1)
    drafts = torch.where(torch.rand(batch, k, device="cuda", generator=generator) < 0.7, right, (right + 1) % vocab)
    return VerifyInput(
        target_probs=target,
        draft_tokens=drafts if k else torch.full((batch, 0), PAD_TOKEN, device="cuda"),
        num_drafts=torch.full((batch,), k, device="cuda"),
        draft_probs=None,
        greedy=torch.arange(batch, device="cuda") % 4 == 0,
        seeds=torch.arange(batch, device="cuda"),
        positions=torch.full((batch,), 100, device="cuda"),
        top_p=torch.full((batch,), 0.9, device="cuda"),
    )


def bench_verify(
    batches: list[int], vocabs: list[int], ks: list[int], reps: int, generator: torch.Generator
) -> list[dict]:
    from services.worker.sampling.rejection import verify_fused, verify_torch

    rows = []
    for strategy in VERIFY_STRATEGIES:
        for vocab in vocabs:
            for batch in batches:
                for k in ks:
                    inp = _verify_input(batch, k, vocab, generator)
                    rows.append(_report(f"verify/{strategy}", f"B={batch} K={k} V={vocab}", inp.target_probs.nbytes,
                                        lambda: verify_fused(inp, "normal", strategy),
                                        lambda: verify_torch(inp, "normal", strategy), reps))  # fmt: skip
    return rows


def bench_logprobs(batches: list[int], top_ks: list[int], reps: int, generator: torch.Generator) -> list[dict]:
    from kernels.logprobs import token_logprobs_launch
    from services.worker.sampling.logprobs import token_logprobs_torch

    rows = []
    for top_k in top_ks:
        for batch in batches:
            logits = 4 * torch.randn(batch, LOGPROBS_VOCAB, device="cuda", generator=generator)
            chosen = torch.randint(0, LOGPROBS_VOCAB, (batch,), device="cuda", generator=generator)
            args = (logits, chosen, top_k)
            rows.append(_report(f"logprobs/top{top_k}", f"N={batch} V={LOGPROBS_VOCAB}", logits.nbytes,
                                lambda: token_logprobs_launch(*args), lambda: token_logprobs_torch(*args),
                                reps))  # fmt: skip
    return rows


def bench_ngram(batches: list[int], ks: list[int], reps: int, generator: torch.Generator) -> list[dict]:
    from kernels.ngram import ngram_propose_launch
    from services.worker.drafting.ngram_batch import ngram_propose_torch

    rows = []
    for batch in batches:
        tokens = torch.randint(0, NGRAM_ALPHABET, (batch, NGRAM_CONTEXT), device="cuda", generator=generator)
        lengths = torch.full((batch,), NGRAM_CONTEXT, device="cuda")
        k = max(ks)
        args = (tokens, lengths, torch.full((batch,), k, device="cuda"), k, NGRAM_MAX, NGRAM_MIN)
        rows.append(_report("ngram", f"B={batch} L={NGRAM_CONTEXT} K={k}", tokens.nbytes,
                            lambda: ngram_propose_launch(*args), lambda: ngram_propose_torch(*args), reps))  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--vocabs", type=int, nargs="+", default=[32000, 151936])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 3, 5])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--logprobs-batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--logprobs-top-k", type=int, nargs="+", default=[0, 20])
    parser.add_argument("--only", choices=KERNELS, nargs="+", default=list(KERNELS), help="kernels to time")
    parser.add_argument("--out", type=Path, default=None, help="a directory to write kernels.json to")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks.kernels needs a CUDA GPU: the Triton kernels run on CUDA tensors only (torch sees none)")
    generator = torch.Generator(device="cuda").manual_seed(0)
    device = torch.cuda.get_device_name()
    print(f"device: {device}")
    rows = []
    if "sample" in args.only:
        rows += bench_sampling(args.batches, args.vocabs, args.reps, generator)
    if "verify" in args.only:
        rows += bench_verify(args.batches, args.vocabs, args.ks, args.reps, generator)
    if "logprobs" in args.only:
        rows += bench_logprobs(args.logprobs_batches, args.logprobs_top_k, args.reps, generator)
    if "ngram" in args.only:
        rows += bench_ngram(args.batches, args.ks, args.reps, generator)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        report = {"device_name": device, "torch_version": torch.__version__, "rows": rows}
        (args.out / "kernels.json").write_text(json.dumps(report, indent=2) + "\n")
    differ = [f"{r['kernel']} {r['shape']}" for r in rows if not r["same"]]
    if differ:
        sys.exit(f"kernel and twin differ: {'; '.join(differ)}")


if __name__ == "__main__":
    main()
