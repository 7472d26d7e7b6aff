"""A step's keys and values written into one layer's paged caches by flat slot (services/worker/kv_cache.py): the
kernel of kernels/kv_write.py on CUDA (keys and values in one launch), `write_kv_torch` (its twin and the CPU
path) elsewhere."""

from __future__ import annotations

from torch import Tensor

from kernels import use_kernel


def write_kv(key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor, k: Tensor, v: Tensor) -> None:
    """key_cache, value_cache [num_blocks, block_size, kv_heads, head_dim]; slot_mapping [T] int64 flat slots
    (block * block_size + offset); k, v [T, kv_heads, head_dim], cast to the caches' dtype."""
    if use_kernel(k):
        # Imported here: CPU callers never need triton.
        from kernels.kv_write import kv_write_launch

        kv_write_launch(key_cache, value_cache, slot_mapping, k, v)
        return
    write_kv_torch(key_cache, value_cache, slot_mapping, k, v)


def write_kv_torch(key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor, k: Tensor, v: Tensor) -> None:
    """`write_kv` in torch ops, on any device: the kernel's reference and the CPU path."""
    key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(key_cache.dtype))
    value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(value_cache.dtype))
