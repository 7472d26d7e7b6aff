"""The KV cache write: a step's keys and values stored at their flat slots (block * block_size + offset) of one
layer's paged caches, keys and values in one launch. Twin: services/worker/kv_write.write_kv_torch (equal: a copy,
cast to the cache's dtype).

Layout: one program per token, all of its kv heads in one tile; k and v may be strided views of a fused qkv
projection (heads and head_dim read in place), so nothing is copied before the write.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.rounding import cast

NUM_WARPS = 4


@triton.jit
def _kv_write_kernel(
    k_ptr,  # [T, kv_heads, head_dim], head_dim contiguous
    v_ptr,  # same
    key_cache_ptr,  # [num_blocks * block_size, kv_heads, head_dim], contiguous
    value_cache_ptr,  # same
    slot_mapping_ptr,  # [T] int64
    num_kv_heads,
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,  # powers of two (tl.arange needs them)
    HEADS_PADDED: tl.constexpr,
    INTERPRETED: tl.constexpr,  # CPU tensors in Triton's interpreter: bfloat16 rounding done on the bits
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    heads = tl.arange(0, HEADS_PADDED)[:, None]
    dims = tl.arange(0, HEAD_DIM_PADDED)[None, :]
    inside = (heads < num_kv_heads) & (dims < HEAD_DIM)
    cache_offset = slot * num_kv_heads * HEAD_DIM + heads * HEAD_DIM + dims  # [HEADS, HEAD_DIM]
    k = tl.load(k_ptr + token * stride_k_token + heads * stride_k_head + dims, mask=inside)
    v = tl.load(v_ptr + token * stride_v_token + heads * stride_v_head + dims, mask=inside)
    tl.store(key_cache_ptr + cache_offset, cast(k, key_cache_ptr.dtype.element_ty, INTERPRETED), mask=inside)
    tl.store(value_cache_ptr + cache_offset, cast(v, value_cache_ptr.dtype.element_ty, INTERPRETED), mask=inside)


def kv_write_launch(key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor, k: Tensor, v: Tensor) -> None:
    """Writes k, v [T, kv_heads, head_dim] into key_cache, value_cache [num_blocks, block_size, kv_heads, head_dim]
    at slot_mapping [T] (int64 flat slots, each below num_blocks * block_size). Launches the kernel (CUDA
    tensors, or CPU tensors under TRITON_INTERPRET=1)."""
    assert key_cache.dim() == 4, f"key_cache must be [blocks, block_size, kv_heads, head_dim], got {key_cache.shape}"
    assert value_cache.shape == key_cache.shape, f"value_cache {value_cache.shape} != key_cache {key_cache.shape}"
    assert value_cache.dtype == key_cache.dtype, f"value_cache {value_cache.dtype} != key_cache {key_cache.dtype}"
    assert key_cache.is_contiguous() and value_cache.is_contiguous(), "the caches are written at flat offsets"
    _, _, num_kv_heads, head_dim = key_cache.shape
    assert k.dim() == 3 and k.shape[1:] == (num_kv_heads, head_dim), (
        f"k must be [T, {num_kv_heads}, {head_dim}], got {tuple(k.shape)}"
    )
    assert v.shape == k.shape, f"v {tuple(v.shape)} != k {tuple(k.shape)}"
    assert slot_mapping.shape == (k.shape[0],) and slot_mapping.dtype == torch.int64, (
        f"slot_mapping must be [T] = ({k.shape[0]},) int64, got {tuple(slot_mapping.shape)} {slot_mapping.dtype}"
    )
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if k.shape[0] == 0:
        return
    _kv_write_kernel[(k.shape[0],)](
        k,
        v,
        key_cache,
        value_cache,
        slot_mapping.contiguous(),
        num_kv_heads,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=triton.next_power_of_2(head_dim),
        HEADS_PADDED=triton.next_power_of_2(num_kv_heads),
        INTERPRETED=k.device.type == "cpu",  # CPU tensors reach the kernel only under the interpreter
        num_warps=NUM_WARPS,
    )
