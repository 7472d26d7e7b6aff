"""The KV cache: per layer, a pool of blocks of `block_size` token positions, written and read in place.

A sequence owns a slot, and the slot a table of blocks (services/worker/engine/block_manager.py decides which):
position p of the slot lives in block table[slot, p // block_size] at offset p % block_size. The model writes a
step's keys and values by a flat slot mapping (block * block_size + offset per token,
services/worker/engine/kv_write.py) and the attention op reads the pool through the block tables
(services/worker/model/paged_attention.py), so no step copies a sequence's context. Rewinding after rejected drafts
is just moving the sequence's length back: stale entries past the length are never attended to and are overwritten
later.

The tables live on the host (numpy): the runner packs each step's inputs from them with array operations and
hands the device one copy per step.

Two layouts of the same pool, one per device. On CUDA a layer's cache is [blocks, block_size, kv_heads, head_dim],
what the Triton kernels read. On the CPU it is head-major, [kv_heads, blocks * block_size, head_dim]: a sequence's
run of blocks is then one contiguous stretch per kv head, which attention streams from memory about 2.5x faster
than the 128-byte pieces the block-major layout interleaves (decode at a 2,048-token context, one thread, caches
cold: 0.29 vs 0.79 ms per layer). Flat slot x (block * block_size + offset) indexes dim 0 of the flattened
block-major pool and dim 1 of the head-major one.
"""

from __future__ import annotations

import numpy as np
import torch

from services.worker.engine.block_manager import DROPPED, blocks_for
from services.worker.engine.kv_write import write_kv

DEFAULT_BLOCK_SIZE = 16
BLOCK_TABLE_DTYPE = np.int32


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """torch.zeros, except that on the CPU the memory comes from calloc (numpy's zeros), whose pages the kernel
    maps only when first written (a 2 MiB huge page at a time where transparent huge pages are on): a worker's cache
    for every slot at full length then costs memory as sequences fill it, not at start (64 demo slots of 2,048
    positions: 0.7 GB that torch.zeros would write at once)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    # numpy has no bfloat16: same-width integers, viewed as dtype (zero bits are 0.0 in every float format)
    stand_in = {1: np.int8, 2: np.int16, 4: np.float32, 8: np.float64}[dtype.itemsize]
    return torch.from_numpy(np.zeros(shape, dtype=stand_in)).view(dtype)


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
        hidden_size: int | None = None,
    ) -> None:
        """num_blocks None: every slot gets its own max_model_len positions up front (a static cache, tables
        preset). Otherwise tables start empty and `set_block_table` fills them. hidden_size: keep a hidden state
        per block (an MTP module's input, see boundary_hidden)."""
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
        self.head_major = torch.device(device).type == "cpu"
        if self.head_major:  # [kv_heads, blocks * block_size, head_dim]: see the module docstring
            shape = (num_kv_heads, (num_blocks + 1) * block_size, head_dim)
        else:  # [blocks, block_size, kv_heads, head_dim]: the layout the CUDA kernels read
            shape = (num_blocks + 1, block_size, num_kv_heads, head_dim)
        self.keys = [lazy_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.values = [lazy_zeros(shape, dtype, device) for _ in range(num_layers)]
        # [blocks + 1, hidden] the trunk's hidden state at each block's last position (drafting/mtp.py)
        self.boundary_hidden = (
            torch.zeros(num_blocks + 1, hidden_size, dtype=dtype, device=device) if hidden_size is not None else None
        )
        self.block_tables = np.full(
            (max_num_seqs + 1, self.max_blocks_per_seq), self.padding_block, dtype=BLOCK_TABLE_DTYPE
        )
        if static:
            self.block_tables[:max_num_seqs] = np.arange(num_blocks).reshape(max_num_seqs, -1)

    @property
    def region_len(self) -> int | None:
        """Positions in each slot's home region (block_manager.py hands a slot's blocks out from there), when the
        pool holds one per slot: CPU attention reads decode or verify rows of sequences sitting in theirs in one
        call."""
        if self.num_blocks < self.padding_slot * self.max_blocks_per_seq:
            return None
        return self.max_blocks_per_seq * self.block_size

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def set_block_table(self, slot: int, blocks: list[int]) -> None:
        """The slot's blocks in position order; the rest of its row goes back to the padding block, and so do the
        leading DROPPED entries of a sliding window's sequence (block_manager.py): attention never reads them, and
        a reader that gathers them and masks them out reads the padding block rather than another sequence's."""
        if len(blocks) > self.max_blocks_per_seq:
            raise ValueError(f"{len(blocks)} blocks exceed the {self.max_blocks_per_seq} a sequence may hold")
        row = self.block_tables[slot]
        row[:] = self.padding_block
        row[: len(blocks)] = blocks
        if blocks and blocks[0] == DROPPED:
            row[row == DROPPED] = self.padding_block

    def slot_mapping(self, slots: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Flat pool index (block * block_size + offset) of each (slot, position) pair, on the host."""
        blocks = self.block_tables[slots, positions // self.block_size].astype(np.int64)
        return blocks * self.block_size + positions % self.block_size

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copies whole blocks, (source, destination) pairs: their keys and values in every layer, and their
        boundary hidden states (a prefix cache hit moved to its sequence's home region, block_manager.py)."""
        if not copies:
            return
        device = self.keys[0].device
        sources, destinations = (torch.tensor(ids, device=device) for ids in zip(*copies))
        if self.head_major:
            from_pos, to_pos = self._positions(sources), self._positions(destinations)
            for pool in self.keys + self.values:  # [kv_heads, positions, head_dim]
                pool.index_copy_(1, to_pos, pool.index_select(1, from_pos))
        else:
            for pool in self.keys + self.values:  # [blocks, block_size, kv_heads, head_dim]
                pool.index_copy_(0, destinations, pool.index_select(0, sources))
        if self.boundary_hidden is not None:
            self.boundary_hidden.index_copy_(0, destinations, self.boundary_hidden.index_select(0, sources))

    def read_blocks(self, blocks: list[int]) -> torch.Tensor:
        """Whole blocks out of the pool, in the layout a handoff carries them (services/worker/handoff/format.py):
        [blocks, layers, 2 (keys, values), block_size, kv_heads, head_dim], block-major so that leading blocks the
        receiver already holds are cut off by slicing."""
        device = self.keys[0].device
        ids = torch.tensor(blocks, device=device)
        if self.head_major:
            positions = self._positions(ids)
            heads, _, head_dim = self.keys[0].shape
            per_layer = [
                pool.index_select(1, positions).view(heads, len(blocks), self.block_size, head_dim).permute(1, 2, 0, 3)
                for pool in self.keys + self.values
            ]  # each [blocks, block_size, kv_heads, head_dim]
        else:
            per_layer = [pool.index_select(0, ids) for pool in self.keys + self.values]
        num_layers = len(self.keys)
        stacked = torch.stack(per_layer, dim=1)  # [blocks, 2 * layers, block_size, kv_heads, head_dim]
        return stacked.view(len(blocks), 2, num_layers, *stacked.shape[2:]).transpose(1, 2).contiguous()

    def write_blocks(self, blocks: list[int], data: torch.Tensor) -> None:
        """Writes blocks read by read_blocks (possibly on another worker) into these blocks of the pool."""
        num_layers = len(self.keys)
        expected = (len(blocks), num_layers, 2, self.block_size, *self.position_shape)
        if tuple(data.shape) != expected:
            raise ValueError(f"blocks of shape {tuple(data.shape)} do not fit this cache's {expected}")
        device = self.keys[0].device
        data = data.to(device=device, dtype=self.keys[0].dtype)
        ids = torch.tensor(blocks, device=device)
        positions = self._positions(ids) if self.head_major else None
        for layer in range(num_layers):
            for kind, pool in enumerate((self.keys[layer], self.values[layer])):
                part = data[:, layer, kind]  # [blocks, block_size, kv_heads, head_dim]
                if self.head_major:
                    pool.index_copy_(1, positions, part.permute(2, 0, 1, 3).reshape(pool.shape[0], -1, pool.shape[2]))
                else:
                    pool.index_copy_(0, ids, part)

    def _positions(self, blocks: torch.Tensor) -> torch.Tensor:
        """Every position of these blocks in the head-major pool, block after block: [blocks * block_size]."""
        offsets = torch.arange(self.block_size, device=blocks.device)
        return (blocks[:, None] * self.block_size + offsets).flatten()

    @property
    def position_shape(self) -> tuple[int, int]:
        """(kv_heads, head_dim) of one position."""
        pool = self.keys[0]
        return (pool.shape[0], pool.shape[2]) if self.head_major else (pool.shape[2], pool.shape[3])

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slot_mapping [T] flat pool indices; k, v [T, kv_heads, head_dim] (views of a fused projection are fine)."""
        write_kv(self.keys[layer], self.values[layer], slot_mapping, k, v)
