"""A step's keys and values written into one layer's paged caches by flat slot (services/worker/engine/kv_cache.py): the
kernel of kernels/kv_write.py on CUDA (keys and values in one launch), `write_kv_torch` (its twin and the CPU
path) elsewhere."""

from __future__ import annotations

from torch import Tensor

from kernels import use_kernel

BLOCK_MAJOR_DIMS = 4  # [blocks, block_size, kv_heads, head_dim]; the head-major layout has 3


def write_kv(key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor, k: Tensor, v: Tensor) -> None:
    """key_cache, value_cache [num_blocks, block_size, kv_heads, head_dim], or head-major [kv_heads, num_blocks *
    block_size, head_dim] (the CPU's layout, services/worker/engine/kv_cache.py); slot_mapping [T] int64 flat slots
    (block * block_size + offset); k, v [T, kv_heads, head_dim], cast to the caches' dtype."""
    if use_kernel(k) and key_cache.dim() == BLOCK_MAJOR_DIMS:
        # Imported here: CPU callers never need triton.
        from kernels.kv_write import kv_write_launch

        kv_write_launch(key_cache, value_cache, slot_mapping, k, v)
        return
    write_kv_torch(key_cache, value_cache, slot_mapping, k, v)


def write_kv_torch(key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor, k: Tensor, v: Tensor) -> None:
    """`write_kv` in torch ops, on any device: the kernel's reference and the CPU path."""
    if k.dtype != key_cache.dtype:
        k, v = k.to(key_cache.dtype), v.to(value_cache.dtype)
    if key_cache.dim() == BLOCK_MAJOR_DIMS:
        key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, slot_mapping, k)
        value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, slot_mapping, v)
    else:
        key_cache.index_copy_(1, slot_mapping, k.transpose(0, 1))
        value_cache.index_copy_(1, slot_mapping, v.transpose(0, 1))
