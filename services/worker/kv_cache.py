"""The KV cache behind a small interface: a static tensor per layer, one row per sequence slot.

Memory is allocated once from `max_num_seqs` and `max_model_len`. A sequence owns a slot; its keys and values
live at their token positions, so rewinding after rejected drafts is just moving the sequence's length back:
stale entries past the length are masked out and later overwritten. A block-paged cache can replace this
class by keeping the same three methods (`write`, `read`, `num_slots`) and mapping (slot, position) to blocks.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self,
        num_layers: int,
        max_num_seqs: int,
        max_model_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        # One extra slot takes the writes of padding tokens, so padding never touches a live sequence.
        self.padding_slot = max_num_seqs
        shape = (max_num_seqs + 1, num_kv_heads, max_model_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_model_len = max_model_len

    @property
    def num_slots(self) -> int:
        return self.padding_slot

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots [B, L] (padding_slot for padding), positions [B, L], k/v [B, L, kv_heads, head_dim]."""
        self.keys[layer][slots, :, positions] = k.to(self.keys[layer].dtype)
        self.values[layer][slots, :, positions] = v.to(self.values[layer].dtype)

    def read(self, layer: int, slots: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions [0, length) for slots [B]: each [B, kv_heads, length, head_dim]."""
        return self.keys[layer][slots, :, :length], self.values[layer][slots, :, :length]
