"""The KV-write kernel, run by Triton's interpreter on CPU tensors, against its torch twin: keys and values that
are strided views of a fused qkv projection, slots scattered over a paged pool (the rest of the pool untouched),
float32 and bfloat16 caches, float32 inputs rounded into a bfloat16 cache; the CPU cache's head-major layout holds
what the kernel writes into the block-major one."""

from __future__ import annotations

from tests.kernelfixture import single_thread  # noqa: F401  (first: it puts triton in interpreter mode)

import pytest
import torch

pytest.importorskip("triton")

from kernels.kv_write import kv_write_launch  # noqa: E402
from services.worker.engine.kv_cache import KVCache  # noqa: E402
from services.worker.engine.kv_write import write_kv, write_kv_torch  # noqa: E402

NUM_BLOCKS, BLOCK_SIZE = 6, 16
TOKENS = 11
HEADS = 4


def _pool(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value pools holding noise, so a write to a wrong slot or a missed one shows."""
    generator = torch.Generator().manual_seed(0)
    shape = (NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim)
    return torch.randn(shape, generator=generator).to(dtype), torch.randn(shape, generator=generator).to(dtype)


def _step(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k, v) [T, kv_heads, head_dim] as views into a fused [T, heads + 2 kv_heads, head_dim] projection, and
    distinct scattered slots [T] int64."""
    generator = torch.Generator().manual_seed(num_kv_heads * head_dim)
    qkv = torch.randn(TOKENS, HEADS + 2 * num_kv_heads, head_dim, generator=generator).to(dtype)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=generator)[:TOKENS]
    return qkv[:, HEADS : HEADS + num_kv_heads], qkv[:, HEADS + num_kv_heads :], slots


@pytest.mark.parametrize(
    ("cache_dtype", "input_dtype"),
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)],
)
@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(2, 16), (3, 24)])
def test_kernel_writes_what_the_twin_writes(
    cache_dtype: torch.dtype, input_dtype: torch.dtype, num_kv_heads: int, head_dim: int
) -> None:
    k, v, slots = _step(num_kv_heads, head_dim, input_dtype)
    assert k.stride(-1) == 1 and not k.is_contiguous()
    got_keys, got_values = _pool(num_kv_heads, head_dim, cache_dtype)
    want_keys, want_values = _pool(num_kv_heads, head_dim, cache_dtype)
    kv_write_launch(got_keys, got_values, slots, k, v)
    write_kv_torch(want_keys, want_values, slots, k, v)
    assert torch.equal(got_keys, want_keys) and torch.equal(got_values, want_values)


def test_through_the_cache_and_an_empty_step() -> None:
    """The CPU cache (head-major) holds, slot for slot, what the kernel writes into the CUDA layout (block-major)."""
    cache = KVCache(2, 2, 40, 2, 16, torch.float32, "cpu", num_blocks=NUM_BLOCKS - 1)  # + the padding block
    assert cache.head_major and cache.keys[1].shape == (2, NUM_BLOCKS * BLOCK_SIZE, 16)
    k, v, slots = _step(2, 16, torch.float32)
    cache.write(1, slots, k, v)  # the dispatcher: the twin on CPU tensors
    assert torch.equal(cache.keys[1][:, slots].transpose(0, 1), k)
    assert torch.equal(cache.values[1][:, slots].transpose(0, 1), v)
    keys, values = (torch.zeros(NUM_BLOCKS, BLOCK_SIZE, 2, 16) for _ in range(2))
    kv_write_launch(keys, values, slots, k, v)
    assert torch.equal(keys.view(-1, 2, 16).transpose(0, 1), cache.keys[1])
    assert torch.equal(values.view(-1, 2, 16).transpose(0, 1), cache.values[1])

    before = keys.clone()
    kv_write_launch(keys, values, slots[:0], k[:0], v[:0])
    assert torch.equal(keys, before)


def test_dispatcher_runs_the_twin_on_cpu_and_launcher_checks_shapes() -> None:
    k, v, slots = _step(2, 16, torch.float32)
    got, want = _pool(2, 16, torch.float32), _pool(2, 16, torch.float32)
    write_kv(*got, slots, k, v)
    write_kv_torch(*want, slots, k, v)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    keys, values = _pool(2, 16, torch.float32)
    with pytest.raises(AssertionError, match="slot_mapping"):
        kv_write_launch(keys, values, slots.to(torch.int32), k, v)
    with pytest.raises(AssertionError, match="k must be"):
        kv_write_launch(keys, values, slots, k[:, :1], v)
    with pytest.raises(AssertionError, match="value_cache"):
        kv_write_launch(keys, values.to(torch.bfloat16), slots, k, v)
