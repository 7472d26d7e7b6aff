"""Which KV-cache blocks each sequence owns. Plain-Python bookkeeping, unit-tested without a model.

The cache is divided into blocks of `block_size` token positions. A running sequence holds a table of blocks,
keyed by its cache slot: position p lives in block table[p // block_size] at offset p % block_size. Tables
grow while a sequence runs (positions past a rejected draft are overwritten later, not returned) and are let go
whole when it finishes or is preempted. Under a sliding window (Mistral) a running sequence also lets go of its
leading blocks that no later pass will read or write (`drop_before`, the scheduler says where): their entries
become DROPPED, so a table keeps its length and a position its index.

A block may have several holders, counted: the choices of one request share their prompt's full blocks (`share`),
and with prefix caching a sequence starts from the cached blocks of its prompt's prefix (`reuse`). Shared blocks
are only ever read: a sequence writes its positions from its own length on, past every full block it shares. A
block whose last holder lets go returns to the pool, or, when it is named in the prefix cache (prefix_cache.py),
stays cached and idle until the pool needs it.

Blocks are handed out so that a sequence's table is one ascending run whenever the pool allows: a slot's block i
is block i of its home region (slot * max_blocks_per_seq .., when the pool holds a whole region per slot, as it does
by default), if free. Attention then reads such a sequence's context as one view of the cache, with no copy
(model/paged_attention.py); when the pool is tight, any free block will do, lowest id first. With `copy_hits` (the
CPU, whose attention reads home regions in one call) a cached block found outside the slot's home position is
copied there rather than shared: a copy of its keys and values costs far less than the per-step attention over a
table that is no longer one run, and home regions are reserved per slot anyway.

A new sequence is given a free slot whose region holds no cached block but its own (its prefix's, and a block it
will write again the same: the one a lookup leaves to compute), which its growth would overwrite: the one holding
most of them in place (copied least), else the lowest empty one. A region holding a prefix the sequence shares and
more (another conversation after the same system prompt) is left to that conversation: the shared blocks are copied
out of it instead. Where every free region holds other cache, the one idle longest, whose cache is the least likely
to be asked for again. (A region holding the sequence's own prefix and more cannot tell whether the more is its own
stale turn, a reasoning model's thinking the history leaves out, or another chat after a shared system prompt: the
blocks say neither. Going there would overwrite the most recent chat in the second case; the region idle longest
loses the oldest in both.) On the GPU (no copies) the choice only spreads sequences; any block serves any table.
CPU attention reads a decode batch's regions in runs of neighbours (model/home_pass.py), so sequences spread over the
cache cost their own regions and the odd idle one between them. Reusing the holes among the running sequences before
any region above them would keep them together, but overwrote conversations' caches while empty regions waited:
with two workers prefix-aware routing found 0.70 of the turns' prompt tokens cached instead of 0.85.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter

from shared.prefix_hash import BlockHash
from services.worker.engine.prefix_cache import PrefixCache

NO_BLOCK = -1  # no block wanted in particular
DROPPED = -2  # a table entry whose block a sliding window left behind and the sequence let go (never read)


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` positions."""
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, max_model_len: int, max_num_seqs: int | None = None,
        caching: bool = False, copy_hits: bool = False,
    ) -> None:
        """max_num_seqs: slots, for home regions (None: as many as the pool holds). caching: keep named blocks
        after their holders let go (prefix caching). copy_hits: copy cached blocks to the slot's home positions."""
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
        slots = num_blocks // self.max_blocks_per_seq if max_num_seqs is None else max_num_seqs
        self.has_regions = slots * self.max_blocks_per_seq <= num_blocks
        self.caching = caching
        self.copy_hits = copy_hits and self.has_regions
        self.cache = PrefixCache(self.max_blocks_per_seq if self.has_regions else None)
        self._free = set(range(num_blocks))  # free and holding nothing worth keeping
        self._lowest = list(range(num_blocks))  # a heap over free ids; entries of taken blocks are skipped lazily
        self._tables: dict[int, list[int]] = {}
        self._num_dropped: dict[int, int] = {}  # by slot: its table's leading DROPPED entries
        self._holders: dict[int, int] = {}  # blocks in use: how many tables (or pending copies) hold each
        self._changed: set[int] = set()
        self._copies: list[tuple[int, int]] = []  # (source, destination) blocks to copy before the next pass
        self._clock = itertools.count()
        self._freed_at: dict[int, int] = {}  # by slot: when it last let its blocks go

    @property
    def num_free(self) -> int:
        """Blocks the pool can hand out: free ones and idle cached ones."""
        return len(self._free) + self.cache.num_idle

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks a sequence needs to hold positions [0, num_tokens); positions past max_model_len are never
        written, so the need stops there."""
        return min(blocks_for(num_tokens, self.block_size), self.max_blocks_per_seq)

    def table(self, slot: int) -> list[int]:
        """The slot's blocks in position order, DROPPED where it let one go (empty when it holds none)."""
        return list(self._tables.get(slot, ()))

    def num_missing(self, slot: int, num_tokens: int) -> int:
        """Blocks the slot must still receive to hold `num_tokens` positions."""
        return max(0, self.blocks_needed(num_tokens) - len(self._tables.get(slot, ())))

    def can_allocate(self, slot: int, num_tokens: int, num_shared: int = 0) -> bool:
        """Whether the slot can hold `num_tokens` positions, `num_shared` of its blocks to be shared first."""
        return self.num_missing(slot, num_tokens) - num_shared <= self.num_free

    def share(self, slot: int, source: int, num_blocks: int) -> None:
        """Starts the empty slot's table with the first `num_blocks` blocks of the source slot's, held by both."""
        if self._tables.get(slot):
            raise RuntimeError(f"slot {slot} already holds blocks; only an empty slot can share")
        shared = self._tables.get(source, [])[:num_blocks]
        if len(shared) < num_blocks:
            raise RuntimeError(f"slot {source} holds {len(shared)} blocks, fewer than the {num_blocks} to share")
        for block in shared:
            self._holders[block] += 1
        self._tables[slot] = list(shared)
        self._changed.add(slot)

    def lookup(self, names: list[BlockHash]) -> list[int]:
        """The cached blocks of the longest run of leading names found (none without caching)."""
        return self.cache.lookup(names) if self.caching else []

    def choose_slot(self, free_slots: list[int], names: list[BlockHash]) -> int:
        """The free slot for a new sequence whose full blocks are named `names` (its cached prefix among them; see
        the module docstring)."""
        if not self.has_regions:
            return free_slots[-1]
        region = self.max_blocks_per_seq
        own: Counter[int] = Counter()  # by slot: idle blocks holding the sequence's own blocks at their home index
        for index, name in enumerate(names):
            block = self.cache.find(name)
            if block is not None and block % region == index and self.cache.is_idle(block):
                own[block // region] += 1
        spared = [s for s in free_slots if self.cache.idle_in_region(s) == own[s]]
        if spared:
            return max(spared, key=lambda s: (own[s], -s))
        return min(free_slots, key=lambda s: self._freed_at.get(s, -1))

    def can_reuse(self, slot: int, num_tokens: int, hits: list[int]) -> bool:
        """Whether the empty slot can start from the cached blocks `hits` and grow to `num_tokens` positions."""
        held = sum(self.cache.is_idle(b) for b in hits)  # idle hits leave the pool while held
        copied = sum(not self._in_place(slot, i, b) for i, b in enumerate(hits))
        return held + copied + max(0, self.blocks_needed(num_tokens) - len(hits)) <= self.num_free

    def reuse(self, slot: int, hits: list[int]) -> None:
        """Starts the empty slot's table with the contents of the cached blocks `hits`: held in place, or copied to
        the slot's home positions (take_copies) with `copy_hits`."""
        if self._tables.get(slot):
            raise RuntimeError(f"slot {slot} already holds blocks; only an empty slot can reuse cached ones")
        for block in hits:  # held first, so that no destination below evicts a source
            self._hold(block)
        table = self._tables.setdefault(slot, [])
        for index, block in enumerate(hits):
            if self._in_place(slot, index, block):
                table.append(block)
            else:
                destination = self._take(self._wanted(slot, table))
                self._copies.append((block, destination))
                table.append(destination)
        self._changed.add(slot)

    def _in_place(self, slot: int, index: int, block: int) -> bool:
        home = self._home(slot)
        return not self.copy_hits or home == NO_BLOCK or block == home + index

    def take_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) block copies `reuse` planned, to run before the next pass; their sources are
        let go here, their contents still intact until the pool hands them out again."""
        copies, self._copies = self._copies, []
        for source, _ in copies:
            self._release(source)
        return copies

    def publish(self, slot: int, first: int, names: list[BlockHash]) -> None:
        """Names the slot's blocks first, first + 1, .. (full blocks of accepted tokens) in the prefix cache."""
        if not self.caching:
            return
        if first < self._num_dropped.get(slot, 0):
            raise RuntimeError(f"slot {slot} let go of block {first} before naming it")
        table = self._tables[slot]
        for index, name in enumerate(names, first):
            displaced = self.cache.register(table[index], name)
            if displaced is not None:
                self._return(displaced)

    def allocate(self, slot: int, num_tokens: int) -> None:
        """Grows the slot's table to hold `num_tokens` positions."""
        missing = self.num_missing(slot, num_tokens)
        if missing > self.num_free:
            raise RuntimeError(f"slot {slot} needs {missing} more KV blocks but only {self.num_free} are free")
        if missing:
            table = self._tables.setdefault(slot, [])
            for _ in range(missing):
                table.append(self._take(self._wanted(slot, table)))
            self._changed.add(slot)

    def _wanted(self, slot: int, table: list[int]) -> int:
        """The block that keeps the slot's table one ascending run: the one after its last, or the home region's
        block at the table's next index when the table starts with blocks outside the region (shared or reused)."""
        home = self._home(slot)
        if not table:
            return home
        last = table[-1]
        if home != NO_BLOCK and not home <= last < home + self.max_blocks_per_seq:
            return home + len(table)
        return last + 1

    def _home(self, slot: int) -> int:
        """The first block of the slot's home region, or NO_BLOCK when the pool is too small for one region per slot."""
        start = slot * self.max_blocks_per_seq
        return start if start + self.max_blocks_per_seq <= self.num_blocks else NO_BLOCK

    def _take(self, wanted: int) -> int:
        """The wanted block if it is free (or, in a home region, idle in the cache); else the lowest free one; else
        the least recently used idle one. Held once."""
        if wanted in self._free:
            self._free.remove(wanted)
        elif self.copy_hits and self.cache.is_idle(wanted):
            self.cache.evict(wanted)  # its own region's stale cache: the CPU's one-call attention needs the run
        elif self._free:
            while self._lowest[0] not in self._free:
                heapq.heappop(self._lowest)
            wanted = heapq.heappop(self._lowest)
            self._free.remove(wanted)
        else:
            wanted = self.cache.evict_lru()
        self._holders[wanted] = 1
        return wanted

    def _hold(self, block: int) -> None:
        if self.cache.is_idle(block):
            self.cache.unpark(block)
            self._holders[block] = 1
        else:
            self._holders[block] += 1

    def _release(self, block: int) -> None:
        holders = self._holders[block] - 1
        if holders:
            self._holders[block] = holders
            return
        del self._holders[block]
        if self.caching and self.cache.is_named(block):
            self.cache.park(block)
        else:
            self._return(block)

    def _return(self, block: int) -> None:
        """A block that holds nothing worth keeping goes back to the pool."""
        self._free.add(block)
        if len(self._lowest) > 2 * self.num_blocks:  # drop stale entries before they pile up
            self._lowest = sorted(self._free)
        else:
            heapq.heappush(self._lowest, block)

    def drop_before(self, slot: int, position: int) -> None:
        """Lets go of the slot's blocks that hold only positions before `position`, which its sequence will never
        read or write again (they fell out of a sliding window): each returns to the pool, or idles in the cache when
        it is named, once no one else holds it. Their table entries become DROPPED."""
        table = self._tables.get(slot)
        if not table:
            return
        start = self._num_dropped.get(slot, 0)
        stop = min(position // self.block_size, len(table))
        if stop <= start:
            return
        for index in range(stop - 1, start - 1, -1):  # tail first, as `free` lets a prefix go
            self._release(table[index])
            table[index] = DROPPED
        self._num_dropped[slot] = stop
        self._changed.add(slot)

    def free(self, slot: int) -> None:
        """Lets go of the slot's blocks: each returns to the pool (or idles in the cache) once no one holds it."""
        table = self._tables.pop(slot, [])
        dropped = self._num_dropped.pop(slot, 0)
        if table:
            self._changed.add(slot)
            self._freed_at[slot] = next(self._clock)
        for index in range(len(table) - 1, dropped - 1, -1):  # tail first: the cache evicts a prefix's tail first
            self._release(table[index])

    def take_changed(self) -> dict[int, list[int]]:
        """The tables changed since the last call (an empty list for a slot that was freed), for the cache's copy."""
        changed = {slot: self.table(slot) for slot in sorted(self._changed)}
        self._changed.clear()
        return changed
