"""Which KV-cache blocks each sequence owns. Plain-Python bookkeeping, unit-tested without a model.

The cache is divided into blocks of `block_size` token positions. A running sequence holds a table of blocks,
keyed by its cache slot: position p lives in block table[p // block_size] at offset p % block_size. Tables
only grow while a sequence runs (positions past a rejected draft are overwritten later, not returned) and are
freed whole when it finishes or is preempted.

The choices of one request share their prompt's full blocks (`share`): a block then has several owners and
returns to the pool when the last of them frees it. Shared blocks are only ever read: a sequence writes its
positions from its own length on, and a shared block lies wholly inside the prompt.

Blocks are handed out so that a sequence's table is one ascending run whenever the pool allows: a slot's first
block comes from its home region (slot * max_blocks_per_seq .., when the pool holds a whole region per slot, as
it does by default) and each next block is the one after its last, if free. Attention then reads such a
sequence's context as one view of the cache, with no copy (model/paged_attention.py); when the pool is tight,
any free block will do, lowest id first.
"""

from __future__ import annotations

import heapq


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` positions."""
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_blocks_per_seq = blocks_for(max_model_len, block_size)
        # A sequence that cannot fit alone could never finish, whatever is preempted for it.
        if num_blocks < self.max_blocks_per_seq:
            raise ValueError(
                f"{num_blocks} KV blocks of {block_size} positions cannot hold one sequence of max_model_len "
                f"{max_model_len}: it needs {self.max_blocks_per_seq}"
            )
        self._free = set(range(num_blocks))
        self._lowest = list(range(num_blocks))  # a heap over free ids; entries of taken blocks are skipped lazily
        self._tables: dict[int, list[int]] = {}
        self._extra_owners: dict[int, int] = {}  # shared blocks: owners beyond the first
        self._changed: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks a sequence needs to hold positions [0, num_tokens); positions past max_model_len are never
        written, so the need stops there."""
        return min(blocks_for(num_tokens, self.block_size), self.max_blocks_per_seq)

    def table(self, slot: int) -> list[int]:
        """The slot's blocks in position order (empty when it holds none)."""
        return list(self._tables.get(slot, ()))

    def num_missing(self, slot: int, num_tokens: int) -> int:
        """Blocks the slot must still receive to hold `num_tokens` positions."""
        return max(0, self.blocks_needed(num_tokens) - len(self._tables.get(slot, ())))

    def can_allocate(self, slot: int, num_tokens: int, num_shared: int = 0) -> bool:
        """Whether the slot can hold `num_tokens` positions, `num_shared` of its blocks to be shared first."""
        return self.num_missing(slot, num_tokens) - num_shared <= len(self._free)

    def share(self, slot: int, source: int, num_blocks: int) -> None:
        """Starts the empty slot's table with the first `num_blocks` blocks of the source slot's, owned by both."""
        if self._tables.get(slot):
            raise RuntimeError(f"slot {slot} already holds blocks; only an empty slot can share")
        shared = self._tables.get(source, [])[:num_blocks]
        if len(shared) < num_blocks:
            raise RuntimeError(f"slot {source} holds {len(shared)} blocks, fewer than the {num_blocks} to share")
        for block in shared:
            self._extra_owners[block] = self._extra_owners.get(block, 0) + 1
        self._tables[slot] = list(shared)
        self._changed.add(slot)

    def allocate(self, slot: int, num_tokens: int) -> None:
        """Grows the slot's table to hold `num_tokens` positions."""
        missing = self.num_missing(slot, num_tokens)
        if missing > len(self._free):
            raise RuntimeError(f"slot {slot} needs {missing} more KV blocks but only {len(self._free)} are free")
        if missing:
            table = self._tables.setdefault(slot, [])
            for _ in range(missing):
                table.append(self._take(table[-1] + 1 if table else self._home(slot)))
            self._changed.add(slot)

    def _home(self, slot: int) -> int:
        """The first block of the slot's home region, or -1 when the pool is too small for one region per slot."""
        start = slot * self.max_blocks_per_seq
        return start if start + self.max_blocks_per_seq <= self.num_blocks else -1

    def _take(self, wanted: int) -> int:
        """The wanted block if it is free, else the lowest free one."""
        if wanted not in self._free:
            while self._lowest[0] not in self._free:
                heapq.heappop(self._lowest)
            wanted = heapq.heappop(self._lowest)
        self._free.remove(wanted)
        return wanted

    def free(self, slot: int) -> None:
        """Returns the slot's blocks to the pool, except shared ones that another slot still owns."""
        table = self._tables.pop(slot, [])
        if table:
            self._changed.add(slot)
        released = []
        for block in table:
            owners = self._extra_owners.get(block, 0)
            if not owners:
                released.append(block)
            elif owners == 1:
                del self._extra_owners[block]
            else:
                self._extra_owners[block] = owners - 1
        self._free.update(released)
        if len(self._lowest) + len(released) > 2 * self.num_blocks:  # drop stale entries before they pile up
            self._lowest = sorted(self._free)
        else:
            for block in released:
                heapq.heappush(self._lowest, block)

    def take_changed(self) -> dict[int, list[int]]:
        """The tables changed since the last call (an empty list for a slot that was freed), for the cache's copy."""
        changed = {slot: self.table(slot) for slot in sorted(self._changed)}
        self._changed.clear()
        return changed
