"""The KV cache behind a small interface: per layer, a pool of blocks of `block_size` token positions.

A sequence owns a slot, and the slot a table of blocks (services/worker/block_manager.py decides which):
position p of the slot lives in block table[slot, p // block_size] at offset p % block_size. Rewinding after
rejected drafts is just moving the sequence's length back: stale entries past the length are masked out and
later overwritten. The model calls only `write` and `read`, so it never sees the blocks.
"""

from __future__ import annotations

import torch

from services.worker.block_manager import blocks_for

DEFAULT_BLOCK_SIZE = 16


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
        block_size: int = DEFAULT_BLOCK_SIZE,
        num_blocks: int | None = None,
    ) -> None:
        """num_blocks None: every slot gets its own max_model_len positions up front (a static cache, tables
        preset). Otherwise tables start empty and `set_block_table` fills them."""
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = blocks_for(max_model_len, block_size)
        static = num_blocks is None
        if static:
            num_blocks = max_num_seqs * self.max_blocks_per_seq
        self.num_blocks = num_blocks
        # One extra block takes the writes of padding tokens, and one extra table row (the padding slot) maps
        # every position there, so padding never touches a live sequence. Unassigned entries point there too.
        self.padding_block = num_blocks
        self.padding_slot = max_num_seqs
        shape = (num_blocks + 1, num_kv_heads, block_size, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.block_tables = torch.full(
            (max_num_seqs + 1, self.max_blocks_per_seq), self.padding_block, dtype=torch.long, device=device
        )
        if static:
            self.block_tables[:max_num_seqs] = torch.arange(num_blocks, device=device).view(max_num_seqs, -1)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def set_block_table(self, slot: int, blocks: list[int]) -> None:
        """The slot's blocks in position order; the rest of its row goes back to the padding block."""
        if len(blocks) > self.max_blocks_per_seq:
            raise ValueError(f"{len(blocks)} blocks exceed the {self.max_blocks_per_seq} a sequence may hold")
        row = torch.full((self.max_blocks_per_seq,), self.padding_block, dtype=torch.long)
        row[: len(blocks)] = torch.tensor(blocks, dtype=torch.long)
        self.block_tables[slot] = row.to(self.block_tables.device)

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots [B, L] (padding_slot for padding), positions [B, L], k/v [B, L, kv_heads, head_dim]."""
        blocks = self.block_tables[slots, positions // self.block_size]
        offsets = positions % self.block_size
        self.keys[layer][blocks, :, offsets] = k.to(self.keys[layer].dtype)
        self.values[layer][blocks, :, offsets] = v.to(self.values[layer].dtype)

    def read(self, layer: int, slots: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions [0, length) for slots [B]: each [B, kv_heads, length, head_dim]."""
        blocks = self.block_tables[slots, : blocks_for(length, self.block_size)]  # [B, n]
        return self._gather(self.keys[layer], blocks, length), self._gather(self.values[layer], blocks, length)

    @staticmethod
    def _gather(pool: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
        batch, n = blocks.shape
        _, heads, block_size, head_dim = pool.shape
        gathered = pool[blocks].transpose(1, 2)  # [B, heads, n, block_size, head_dim]
        return gathered.reshape(batch, heads, n * block_size, head_dim)[:, :, :length]
