"""The engine on CUDA (skipped without a GPU; CI has none): every drafting method still gives transformers' greedy
tokens in float32 alone and in a mixed greedy/sampled batch, a seeded sampled request gets the same tokens as on
the CPU, the fused layer path (RMSNorm + residual, rotary, SiLU-and-mul, KV write kernels) is the one that runs and
still gives transformers' greedy tokens, and every model-op kernel (those and paged attention) matches its twin on
real CUDA tensors of a real checkpoint's shape, in float32 and bfloat16; a dummy 8B shape is drawn straight onto the
device."""

from __future__ import annotations

import pytest
import torch

from kernels import DISABLE_ENV
from services.engine_flags import BFLOAT16_CAPABILITY, resolved_dtype
from services.worker.engine.kv_write import write_kv_torch
from services.worker.model.paged_attention import paged_attention_torch
from services.worker.model.rms_norm import rms_norm_torch
from services.worker.model.rotary_apply import apply_rotary_torch
from services.worker.model.gated_activation import gelu_tanh_and_mul_torch, silu_and_mul_torch
from shared.config import DEFAULT_MODEL_DIR
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
FUSED_KERNELS = ("_rms_norm_kernel", "_rotary_kernel", "_gated_mul_kernel", "_kv_write_kernel")
# Qwen2.5-7B's layer shape: hidden 3584, 28 heads over 4 kv heads of 128, intermediate 18944; 37 tokens.
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, TOKENS = 3584, 28, 4, 128, 18944, 37
EPS = 1e-6
KIB = 1024
SERVED_LEN = 4096  # the dummy 8B load's max_model_len
HOST_SLACK = 1 << 30  # resident host growth allowed while loading 16 GB of weights onto the device
DEVICE_SLACK = 1 << 28  # device memory beyond the weights: the cos/sin table and the allocator's rounding
# Relative: float32 sums in another order, rsqrt and exp from other libraries | one bfloat16 ulp.
RELATIVE_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2.0**-7}


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


def test_the_fused_layer_path_runs_and_gives_transformers_greedy_tokens(
    tiny_model_dir, prompts, greedy_reference, monkeypatch
) -> None:
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    engine = make_engine(tiny_model_dir, METHODS["naive"], device="cuda", enforce_eager=True)
    requests = [make_request(p, **GREEDY) for p in prompts]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        steps = run(engine, {0: requests})
    launched = {event.name for event in profile.events()}
    assert all(kernel in launched for kernel in FUSED_KERNELS), f"not launched: {set(FUSED_KERNELS) - launched}"
    for request, prompt in zip(requests, prompts):
        assert tokens_of(steps, request) == greedy_reference(prompt, NUM_TOKENS)


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.double(), want.double(), rtol=RELATIVE_TOLERANCE[got.dtype], atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_layer_kernels_match_their_twins_on_cuda(dtype: torch.dtype) -> None:
    from kernels.kv_write import kv_write_launch
    from kernels.rms_norm import rms_norm_launch
    from kernels.rotary import rotary_launch
    from kernels.gated_mul import gated_mul_launch

    generator = torch.Generator().manual_seed(1)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to("cuda", dtype)

    x, residual, weight = randn(TOKENS, HIDDEN), randn(TOKENS, HIDDEN), 1 + 0.5 * randn(HIDDEN)
    _assert_close(rms_norm_launch(x, weight, EPS), rms_norm_torch(x, weight, EPS))
    normed, new_residual = rms_norm_launch(x, weight, EPS, residual)
    want_normed, want_residual = rms_norm_torch(x, weight, EPS, residual)
    assert torch.equal(new_residual, want_residual)
    _assert_close(normed, want_normed)

    qkv = randn(TOKENS, HEADS + 2 * KV_HEADS, HEAD_DIM)
    angles = torch.randint(0, 4096, (TOKENS, 1)).float() * 10000.0 ** -(torch.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    cos_sin = torch.stack((angles.cos(), angles.sin()), dim=1).cuda()  # [T, 2, head_dim / 2] float32
    rotated = HEADS + KV_HEADS
    want = apply_rotary_torch(qkv[:, :rotated], cos_sin)
    _assert_close(rotary_launch(qkv[:, :rotated], cos_sin), want)

    gate_up = 4 * randn(TOKENS, 2 * INTERMEDIATE)
    _assert_close(gated_mul_launch(gate_up, "silu"), silu_and_mul_torch(gate_up))
    _assert_close(gated_mul_launch(gate_up, "gelu_tanh"), gelu_tanh_and_mul_torch(gate_up))

    pool = (64, 16, KV_HEADS, HEAD_DIM)
    got_keys, got_values = torch.zeros(pool, dtype=dtype, device="cuda"), torch.zeros(pool, dtype=dtype, device="cuda")
    want_keys, want_values = torch.zeros_like(got_keys), torch.zeros_like(got_values)
    slots = torch.randperm(64 * 16, generator=generator)[:TOKENS].cuda()
    k, v = qkv[:, HEADS:rotated], qkv[:, rotated:]  # strided views of the fused projection
    kv_write_launch(got_keys, got_values, slots, k, v)
    write_kv_torch(want_keys, want_values, slots, k, v)
    assert torch.equal(got_keys, want_keys) and torch.equal(got_values, want_values)


def _resident_bytes() -> int:
    """The process's resident host memory (Linux)."""
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * KIB
    raise RuntimeError("no VmRSS in /proc/self/status")


def test_a_dummy_8b_shape_is_drawn_on_the_device() -> None:
    """Llama-3.1-8B's shape in bfloat16 with random weights, loaded as an engine loads it: every weight is drawn on
    the GPU, none staged on the host (16 GB would show in the process's resident memory), the device holds each
    weight once, and the cos/sin table has max_model_len rows, built there too."""
    from benchmarks import shape
    from services.worker.model.loader import load_model

    torch.zeros(1, device="cuda")  # the CUDA context's own host memory is not the load's
    torch.cuda.reset_peak_memory_stats()
    before = _resident_bytes()
    model = load_model(shape.shape_dir("llama-3.1-8b"), torch.bfloat16, "cuda", "dummy", max_model_len=SERVED_LEN)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert _resident_bytes() - before < HOST_SLACK
    assert torch.cuda.max_memory_allocated() < weights + DEVICE_SLACK
    assert model.rotary.cos_sin.is_cuda and model.rotary.cos_sin.shape[0] == SERVED_LEN


def test_dtype_auto_is_bfloat16_only_where_the_gpu_computes_in_it() -> None:
    """The demo model's config stores bfloat16: auto keeps it on sm_80 and later, float16 before (vLLM's fallback)."""
    has_bf16 = torch.cuda.get_device_capability() >= BFLOAT16_CAPABILITY
    assert resolved_dtype("auto", "cuda", DEFAULT_MODEL_DIR) == ("bfloat16" if has_bf16 else "float16")
