"""The engine on CUDA (skipped without a GPU; CI has none): every drafting method still gives transformers' greedy
tokens in float32 alone and in a mixed greedy/sampled batch, a seeded sampled request gets the same tokens as on
the CPU, and the paged attention kernel matches its twin on real CUDA tensors."""

from __future__ import annotations

import pytest
import torch

from services.worker.model.paged_attention import paged_attention_torch
from tests.methodfixture import (  # noqa: F401  (fixtures are used by name)
    METHOD_NAMES,
    METHODS,
    greedy_reference,
    make_engine,
    make_request,
    model_dirs,
    mtp_model_dir,
    mtp_model_dirs,
    prompts,
    reference_model,
    run,
    tiny_model_dir,
    tokens_of,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

NUM_TOKENS = 24
GREEDY = dict(temperature=0.0, ignore_eos=True, max_tokens=NUM_TOKENS)
SAMPLED = dict(temperature=1.0, top_p=0.9, seed=7, ignore_eos=True, max_tokens=NUM_TOKENS)


@pytest.mark.parametrize("name", METHOD_NAMES)
def test_greedy_and_seeded_tokens_on_cuda(model_dirs, prompts, greedy_reference, name) -> None:
    method = METHODS[name]
    cuda = make_engine(model_dirs(method), method, device="cuda")
    greedy = [make_request(p, logprobs=2, **GREEDY) for p in prompts]
    sampled = make_request(prompts[0], **SAMPLED)
    steps = run(cuda, {0: greedy + [sampled]})
    for request, prompt in zip(greedy, prompts):
        assert tokens_of(steps, request) == greedy_reference(prompt, NUM_TOKENS)
    cpu = make_engine(model_dirs(method), method)
    alone = make_request(prompts[0], **SAMPLED)
    # Sampling compares float32 probabilities computed by different kernels: equal tokens are expected, not
    # guaranteed bit for bit, so the check is on the first tokens, where a tie is least likely.
    assert tokens_of(steps, sampled)[:8] == tokens_of(run(cpu, {0: [alone]}), alone)[:8]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_kernel_matches_the_twin_on_cuda(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    block_size, kv_heads, heads, head_dim, num_blocks = 16, 4, 8, 64, 128
    keys = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator).to("cuda", dtype)
    values = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator).to("cuda", dtype)
    counts, contexts = [1, 4, 37, 1], [300, 20, 37, 1]
    tables = torch.randperm(num_blocks, generator=generator)[: 4 * 20].view(4, 20).to("cuda", torch.int32)
    starts = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(counts), heads, head_dim, generator=generator).to("cuda", dtype)
    args = (q, keys, values, tables, starts, torch.tensor(contexts, dtype=torch.int32, device="cuda"), head_dim**-0.5,
            max(counts), max(contexts))
    from kernels.paged_attention import paged_attention_launch

    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(paged_attention_launch(*args).float(), paged_attention_torch(*args).float(), atol=tolerance)
