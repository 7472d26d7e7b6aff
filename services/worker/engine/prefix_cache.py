"""Which KV blocks hold a known prefix: the index behind prefix caching. Plain Python, unit-tested without a model.

A full block whose every position holds accepted tokens (in the target's layers and, with MTP, the module's) is
named by the hash chained over its sequence's tokens up to its end (shared/prefix_hash.py). A named block stays
in the index after the last sequence holding it lets go: it is then *idle*, still free for the pool to hand out,
and evicted (its name forgotten) least recently used first, or when the pool hands out that very block. A
sequence whose first blocks' names are found starts from them instead of computing them again.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable

from shared.prefix_hash import BlockHash


class PrefixCache:
    def __init__(self, region_size: int | None = None) -> None:
        """region_size: blocks per home region, to count idle blocks per region (BlockManager.choose_slot)."""
        self._block_of: dict[BlockHash, int] = {}
        self._name_of: dict[int, BlockHash] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self._region_size = region_size
        self._idle_per_region: Counter[int] = Counter()
        # Names stored (True) or evicted (False) since take_journal, the last change winning: the worker's cache
        # events for prefix-aware routing (shared/cache_events.py)
        self._journal: dict[BlockHash, bool] = {}

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    @property
    def num_named(self) -> int:
        return len(self._name_of)

    def lookup(self, names: Iterable[BlockHash]) -> list[int]:
        """The blocks holding the longest run of leading names found."""
        found = []
        for name in names:
            block = self._block_of.get(name)
            if block is None:
                break
            found.append(block)
        return found

    def find(self, name: BlockHash) -> int | None:
        """The block holding `name`, if any."""
        return self._block_of.get(name)

    def is_named(self, block: int) -> bool:
        return block in self._name_of

    def is_idle(self, block: int) -> bool:
        return block in self._idle

    def idle_in_region(self, region: int) -> int:
        return self._idle_per_region[region]

    def register(self, block: int, name: BlockHash) -> int | None:
        """Names a block in use. A name already held by another block keeps that block unless it is idle: then the
        block in use takes the name over, since it is the more recently used copy, and the idle one, evicted, is
        returned for the pool to take back."""
        if block in self._name_of:
            return None
        holder = self._block_of.get(name)
        if holder is not None:
            if holder not in self._idle:
                return None
            self.evict(holder)
        self._block_of[name] = block
        self._name_of[block] = name
        self._journal[name] = True
        return holder

    def park(self, block: int) -> None:
        """A named block no sequence holds any more: idle, the most recently used."""
        self._idle[block] = None
        self._count(block, 1)

    def unpark(self, block: int) -> None:
        """An idle block a sequence takes back (a hit): in use again, its name kept."""
        del self._idle[block]
        self._count(block, -1)

    def evict(self, block: int) -> None:
        """Forgets an idle block's name: the pool is about to hand it out."""
        self.unpark(block)
        name = self._name_of.pop(block)
        del self._block_of[name]
        self._journal[name] = False

    def evict_lru(self) -> int:
        """Evicts the least recently used idle block and returns it."""
        block = next(iter(self._idle))
        self.evict(block)
        return block

    def take_journal(self) -> tuple[list[BlockHash], list[BlockHash]]:
        """The names stored and the names evicted since the last call."""
        journal, self._journal = self._journal, {}
        stored = [name for name, present in journal.items() if present]
        return stored, [name for name, present in journal.items() if not present]

    def _count(self, block: int, change: int) -> None:
        if self._region_size is not None:
            self._idle_per_region[block // self._region_size] += change
