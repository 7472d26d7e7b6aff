"""Prefix caching's bookkeeping without a model: block names, the cache of idle blocks (LRU, tail first), reuse in
place or by copy to the slot's home region, slot choice, and the scheduler's admission from cached blocks; and the
cache's block copy against a plain reference."""

from __future__ import annotations

import torch

from services.worker.engine.block_manager import BlockManager
from services.worker.engine.kv_cache import KVCache
from services.worker.engine.prefix_cache import PrefixCache
from services.worker.engine.scheduler import Scheduler
from services.worker.engine.sequence import Sequence
from shared.prefix_hash import DIGEST_BYTES, extend_hashes, root_hash
from shared.schemas import SamplingParams

BLOCK_SIZE = 4
MAX_MODEL_LEN = 16  # 4 blocks per sequence
NUM_SLOTS = 3
ROOT = root_hash("test-model")


def _names(tokens: list[int]) -> list[bytes]:
    return extend_hashes([], ROOT, tokens, BLOCK_SIZE)


def _manager(num_blocks: int = NUM_SLOTS * 4, copy_hits: bool = False) -> BlockManager:
    return BlockManager(num_blocks, BLOCK_SIZE, MAX_MODEL_LEN, NUM_SLOTS, caching=True, copy_hits=copy_hits)


def _cached_and_idle(blocks: BlockManager, slot: int, num_tokens: int) -> list[bytes]:
    """The slot computes num_tokens tokens, names its blocks and lets them go: they idle in the cache. Their names."""
    names = _names(list(range(num_tokens)))
    blocks.allocate(slot, num_tokens)
    blocks.publish(slot, 0, names)
    blocks.free(slot)
    return names


def _seq(tokens: list[int], max_tokens: int = 4, root: bytes | None = ROOT) -> Sequence:
    return Sequence("ab" * 16, tokens, SamplingParams(max_tokens=max_tokens), 0, frozenset(), cache_root=root)


def test_names_chain_over_every_token_before_them() -> None:
    names = _names(list(range(10)))
    assert len(names) == 2 and all(len(n) == DIGEST_BYTES for n in names)  # full blocks only
    assert _names(list(range(8)) + [99]) == names  # the partial block is not named
    changed = _names([7] + list(range(1, 10)))
    assert changed[0] != names[0] and changed[1] != names[1]  # block 1's name depends on block 0's tokens
    assert extend_hashes(names[:1], ROOT, list(range(10)), BLOCK_SIZE) == names  # extended where it stopped
    assert _names(list(range(4))) != extend_hashes([], root_hash("test-model", "salt"), list(range(4)), BLOCK_SIZE)
    assert root_hash("test-model", "") != root_hash("test-model")
    assert root_hash("other-model") != ROOT


def test_an_idle_block_is_found_until_evicted_least_recently_used_first() -> None:
    cache = PrefixCache()
    names = _names(list(range(12)))
    for block, name in zip((5, 6, 7), names):
        cache.register(block, name)
        cache.park(block)
    assert cache.lookup(names) == [5, 6, 7] and cache.num_idle == 3
    cache.unpark(6)  # a hit: in use again
    assert cache.evict_lru() == 5
    assert cache.lookup(names) == []  # the chain's head is gone: nothing after it is reachable
    assert cache.evict_lru() == 7


def test_a_name_held_by_an_idle_copy_moves_to_the_block_in_use() -> None:
    cache = PrefixCache()
    (name,) = _names(list(range(4)))
    cache.register(1, name)
    cache.register(2, name)  # block 1 is in use: it keeps the name
    assert cache.lookup([name]) == [1] and not cache.is_named(2)
    cache.park(1)
    cache.register(2, name)
    assert cache.lookup([name]) == [2] and not cache.is_named(1) and cache.num_idle == 0


def test_freed_blocks_stay_cached_and_are_evicted_tail_first() -> None:
    blocks = BlockManager(8, BLOCK_SIZE, MAX_MODEL_LEN, max_num_seqs=4, caching=True)  # no home regions
    names = _names(list(range(16)))
    blocks.allocate(0, 16)
    blocks.publish(0, 0, names)
    blocks.free(0)
    assert blocks.num_free == 8 and blocks.lookup(names) == [0, 1, 2, 3]
    blocks.allocate(1, 16)
    blocks.allocate(2, 4)  # the pool is out of free blocks: the least recently used idle one goes, the tail
    assert blocks.lookup(names) == [0, 1, 2]


def test_named_blocks_a_sliding_window_drops_stay_cached_for_a_later_sequence() -> None:
    blocks = BlockManager(8, BLOCK_SIZE, MAX_MODEL_LEN, max_num_seqs=4, caching=True)
    names = _names(list(range(12)))
    blocks.allocate(0, 16)
    blocks.publish(0, 0, names)
    blocks.drop_before(0, 8)
    assert blocks.num_free == 6 and blocks.cache.num_idle == 2  # idle, still named
    hits = blocks.lookup(names)
    assert hits == [0, 1, 2]  # the running sequence still holds block 2
    blocks.reuse(1, hits)
    blocks.free(0)
    assert blocks.table(1) == [0, 1, 2] and blocks.num_used == 3


def test_a_hit_in_place_is_shared_and_one_elsewhere_is_copied_to_the_home_region() -> None:
    names = _names(list(range(12)))
    cases = ((False, [0, 1, 2, 7], []), (True, [4, 5, 6, 7], [(0, 4), (1, 5), (2, 6)]))
    for copy_hits, expected_table, expected_copies in cases:
        blocks = _manager(copy_hits=copy_hits)
        blocks.allocate(0, 12)
        blocks.publish(0, 0, names)
        hits = blocks.lookup(names)
        assert blocks.can_reuse(1, 16, hits)
        blocks.reuse(1, hits)
        blocks.allocate(1, 16)
        assert blocks.table(1) == expected_table
        assert blocks.take_copies() == expected_copies
        blocks.free(0)
        blocks.free(1)
        assert blocks.num_free == blocks.num_blocks


def test_copy_sources_survive_until_the_copy_is_taken() -> None:
    blocks = _manager(num_blocks=NUM_SLOTS * 4, copy_hits=True)
    names = _cached_and_idle(blocks, 0, 8)
    hits = blocks.lookup(names)
    blocks.reuse(1, hits)  # sources 0, 1 idle: held until copied
    assert blocks.num_free == blocks.num_blocks - 4
    blocks.allocate(2, 16)
    assert not set(hits) & set(blocks.table(2))
    blocks.take_copies()
    assert blocks.lookup(names) == hits  # still named, idle again


def test_a_new_sequence_gets_the_slot_whose_region_holds_its_prefix_else_an_empty_one() -> None:
    blocks = _manager(copy_hits=True)
    names = _cached_and_idle(blocks, 1, 8)
    free_slots = [2, 1, 0]
    assert blocks.choose_slot(free_slots, names) == 1
    assert blocks.choose_slot(free_slots, []) == 0  # region 1 holds cached blocks: kept for its prefix


def test_a_new_sequence_takes_the_lowest_empty_region_else_the_one_idle_longest() -> None:
    """Sequences kept to few regions cost CPU attention less; regions holding cache keep it while others are empty."""
    slots = 6
    blocks = BlockManager(slots * 4, BLOCK_SIZE, MAX_MODEL_LEN, slots, caching=True, copy_hits=True)
    assert blocks.choose_slot([5, 4, 2, 1], []) == 1
    names = _cached_and_idle(blocks, 1, 8)
    assert blocks.choose_slot([5, 4, 2, 1], []) == 2  # region 1 holds cache: kept
    assert blocks.choose_slot([5, 4, 2, 1], names) == 1  # its prefix's region
    for slot in (2, 4, 5):
        _cached_and_idle(blocks, slot, 8)
    assert blocks.choose_slot([5, 4, 2, 1], []) == 1  # every free region holds cache: the one freed first


def test_the_scheduler_admits_from_the_cached_prefix_and_counts_the_lookup() -> None:
    blocks = _manager(copy_hits=True)
    scheduler = Scheduler(NUM_SLOTS, blocks)
    prompt = list(range(11))
    first = _seq(prompt)
    scheduler.add(first)
    scheduler.schedule()
    first.num_computed = len(prompt)
    blocks.publish(first.slot, 0, first.names(2, BLOCK_SIZE))
    again = _seq(prompt)
    scheduler.add(again)
    plan = scheduler.schedule()
    assert plan.prefills == [again]
    assert again.num_computed == again.num_cached_tokens == 8  # blocks 0, 1; block 2 holds the last prompt token
    assert (scheduler.prefix_queries, scheduler.prefix_hits) == (22, 8)
    uncached = _seq(prompt, root=None)
    scheduler.add(uncached)
    scheduler.schedule()
    assert uncached.num_computed == 0 and scheduler.prefix_queries == 22


def test_copy_blocks_moves_every_layers_keys_values_and_boundary_state() -> None:
    cache = KVCache(2, NUM_SLOTS, MAX_MODEL_LEN, 2, 3, torch.float32, "cpu", BLOCK_SIZE, 12, hidden_size=5)
    for tensor in cache.keys + cache.values + [cache.boundary_hidden]:
        tensor.copy_(torch.randn_like(tensor))
    before = [t.clone() for t in cache.keys + cache.values + [cache.boundary_hidden]]
    cache.copy_blocks([(0, 5), (3, 9)])
    for old, new in zip(before[:-1], cache.keys + cache.values):  # [kv_heads, positions, head_dim]
        expected = old.clone()
        expected[:, 20:24] = old[:, 0:4]
        expected[:, 36:40] = old[:, 12:16]
        assert torch.equal(new, expected)
    expected = before[-1].clone()
    expected[[5, 9]] = before[-1][[0, 3]]
    assert torch.equal(cache.boundary_hidden, expected)


def test_a_copy_published_over_an_idle_original_returns_the_original_to_the_pool() -> None:
    blocks = _manager(copy_hits=True)
    names = _cached_and_idle(blocks, 0, 8)
    blocks.reuse(1, blocks.lookup(names))  # copied to slot 1's home region
    blocks.take_copies()
    blocks.allocate(1, 12)
    blocks.publish(1, 0, names)  # the copies take the names over from the idle originals
    assert blocks.lookup(names) == [4, 5]
    blocks.free(1)
    assert blocks.num_free == blocks.num_blocks and blocks.cache.num_idle == 2


def test_a_sequence_sharing_only_a_prefix_leaves_the_region_of_the_conversation_that_holds_more() -> None:
    """Two conversations after the same system prompt: the second starts in an empty region with the prompt's block
    copied there, rather than in the first's region, where it would overwrite the first's turn; each conversation's
    next turn then finds all of its own blocks."""
    blocks = _manager(copy_hits=True)
    system = list(range(100, 104))  # one block
    first, second = system + list(range(8)), system + list(range(50, 58))
    first_names = _names(first)
    blocks.allocate(0, len(first))
    blocks.publish(0, 0, first_names)
    blocks.free(0)
    hits = blocks.lookup(_names(second))
    assert hits == [0]  # the system prompt, in slot 0's region
    slot = blocks.choose_slot([2, 1, 0], _names(second))
    assert slot == 1
    blocks.reuse(slot, hits)
    blocks.take_copies()
    blocks.allocate(slot, len(second))
    blocks.publish(slot, 0, _names(second))
    blocks.free(slot)
    assert len(blocks.lookup(first_names)) == 3 and len(blocks.lookup(_names(second))) == 3
    # The first conversation's next turn goes home, where its blocks are (the system prompt's copied back).
    assert blocks.choose_slot([2, 1, 0], first_names) == 0


def _turn(blocks: BlockManager, tokens: list[int], free_slots: list[int]) -> tuple[int, int]:
    """A sequence admitted as the scheduler admits it (its prefix looked up leaving a token to compute), run and let
    go; (its slot, the blocks copied for it)."""
    names = _names(tokens)
    hits = blocks.lookup(names[: (len(tokens) - 1) // BLOCK_SIZE])
    slot = blocks.choose_slot(free_slots, names)
    blocks.reuse(slot, hits)
    copied = len(blocks.take_copies())
    blocks.allocate(slot, len(tokens))
    blocks.publish(slot, 0, names)
    blocks.free(slot)
    return slot, copied


def test_the_same_prompt_again_stays_where_its_blocks_are() -> None:
    """A prompt of whole blocks leaves its last one to compute: that block, cached in its region, is its own (it
    writes it again the same), not another's to spare."""
    blocks = _manager(copy_hits=True)
    prompt = list(range(12))  # three whole blocks
    assert _turn(blocks, prompt, [2, 1, 0]) == (0, 0)
    assert _turn(blocks, prompt, [2, 1, 0]) == (0, 0)


def test_with_every_region_taken_a_new_chat_overwrites_the_one_idle_longest() -> None:
    """No empty region: a chat sharing only a system prompt with the others goes to the region idle longest, not over
    the most recent chat after that prompt (which holds more of its blocks in place than any other region)."""
    blocks = _manager(copy_hits=True)
    system = [1] * 4
    oldest, middle, recent = system + [2] * 8, list(range(300, 312)), system + [3] * 8
    assert [_turn(blocks, chat, [2, 1, 0])[0] for chat in (oldest, middle, recent)] == [0, 1, 2]
    assert _turn(blocks, system + [4] * 4, [2, 1, 0])[0] == 0
    assert len(blocks.lookup(_names(recent))) == 3 and len(blocks.lookup(_names(middle))) == 3
