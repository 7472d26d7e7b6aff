"""KV block bookkeeping without a model: allocation, freeing, can_allocate, tables, exhaustion, the blocks a sliding
window leaves behind; and the scheduler's use of it (admission needs the whole prefill, preemption of the newest
sequences, blocks out of a window's reach let go before a step grows the tables)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.worker.engine.block_manager import DROPPED, BlockManager, blocks_for
from services.worker.engine.kv_cache import KVCache
from services.worker.engine.scheduler import Scheduler
from services.worker.engine.sequence import SeqState, Sequence
from services.worker.tensor_parallel.mirror import RecordingKVCache, replay
from shared.schemas import SamplingParams

BLOCK_SIZE = 4
MAX_MODEL_LEN = 16  # 4 blocks per sequence
SEED = 5


def _manager(num_blocks: int) -> BlockManager:
    return BlockManager(num_blocks, BLOCK_SIZE, MAX_MODEL_LEN)


def _seq(name: str, prompt_len: int) -> Sequence:
    request_id = name.encode().hex().ljust(32, "0")
    return Sequence(request_id, list(range(prompt_len)), SamplingParams(max_tokens=MAX_MODEL_LEN), SEED, frozenset())


@pytest.mark.parametrize("num_tokens,expected", [(0, 0), (1, 1), (4, 1), (5, 2), (16, 4)])
def test_blocks_for_rounds_up(num_tokens: int, expected: int) -> None:
    assert blocks_for(num_tokens, BLOCK_SIZE) == expected


def test_allocation_grows_a_table_in_position_order_with_distinct_blocks() -> None:
    blocks = _manager(8)
    blocks.allocate(0, 5)
    assert blocks.table(0) == [0, 1]
    blocks.allocate(1, 3)
    blocks.allocate(0, 8)  # still two blocks: nothing new
    assert blocks.table(0) == [0, 1]
    blocks.allocate(0, 9)
    assert blocks.table(0) == [0, 1, 2]  # one ascending run: slot 1 started in its own home region
    assert blocks.table(1) == [4]
    assert blocks.num_used == 4 and blocks.num_free == 4


def test_tables_stay_one_run_while_the_pool_allows_and_take_the_lowest_free_block_otherwise() -> None:
    blocks = _manager(6)  # less than a home region per slot: first come, lowest id first
    blocks.allocate(0, 4)
    blocks.allocate(1, 4)
    blocks.allocate(0, 8)
    assert blocks.table(0) == [0, 2] and blocks.table(1) == [1]  # block 1 is taken: the lowest free one
    blocks.free(1)
    blocks.allocate(0, 12)
    assert blocks.table(0) == [0, 2, 3]  # the block after its last is free again
    blocks.allocate(2, 8)
    assert blocks.table(2) == [1, 4]


def test_need_stops_at_max_model_len() -> None:
    blocks = _manager(8)
    assert blocks.blocks_needed(MAX_MODEL_LEN + 7) == MAX_MODEL_LEN // BLOCK_SIZE
    blocks.allocate(0, MAX_MODEL_LEN + 7)
    assert len(blocks.table(0)) == MAX_MODEL_LEN // BLOCK_SIZE


def test_free_returns_every_block_and_they_are_reused() -> None:
    blocks = _manager(6)
    blocks.allocate(0, 8)
    blocks.allocate(1, 8)
    freed = blocks.table(0)
    blocks.free(0)
    assert blocks.table(0) == []
    assert blocks.num_free == 4
    blocks.allocate(2, 16)
    assert set(freed) <= set(blocks.table(2))
    assert set(blocks.table(2)).isdisjoint(blocks.table(1))
    blocks.free(5)  # a slot that holds nothing: nothing changes
    assert blocks.num_free == 0


def test_can_allocate_counts_only_the_missing_blocks() -> None:
    blocks = _manager(4)
    blocks.allocate(0, 12)
    assert blocks.num_free == 1
    assert blocks.can_allocate(0, 16)  # one more block
    assert not blocks.can_allocate(1, 5)  # two new blocks
    assert blocks.can_allocate(1, 4)


def test_exhaustion_is_refused_loudly_and_leaves_the_tables_alone() -> None:
    blocks = _manager(4)
    blocks.allocate(0, 12)
    with pytest.raises(RuntimeError, match="needs 2 more KV blocks but only 1 are free"):
        blocks.allocate(1, 8)
    assert blocks.table(1) == [] and blocks.num_free == 1


def test_a_pool_too_small_for_one_sequence_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        _manager(3)


def test_changed_tables_are_reported_once() -> None:
    blocks = _manager(8)
    blocks.allocate(0, 4)
    blocks.allocate(1, 4)
    assert blocks.take_changed() == {0: [0], 1: [4]}
    assert blocks.take_changed() == {}
    blocks.allocate(0, 4)  # nothing new
    blocks.free(1)
    assert blocks.take_changed() == {1: []}


def test_cache_writes_through_scattered_blocks_by_slot_mapping() -> None:
    cache = KVCache(1, 2, MAX_MODEL_LEN, 1, 2, torch.float32, "cpu", BLOCK_SIZE, num_blocks=8)
    cache.set_block_table(1, [6, 2, 4])
    positions = np.arange(10)
    mapping = cache.slot_mapping(np.ones(10, dtype=np.int64), positions)
    assert mapping.tolist() == [6 * BLOCK_SIZE + p for p in range(4)] + [2 * BLOCK_SIZE + p for p in range(4)] + [
        4 * BLOCK_SIZE + p for p in range(2)
    ]
    k = torch.arange(20, dtype=torch.float32).view(10, 1, 2)
    cache.write(0, torch.from_numpy(mapping), k, -k)
    # The CPU cache is head-major, [kv_heads, blocks * block_size, head_dim]: flat slot = block * size + offset.
    assert torch.equal(cache.keys[0][0, 2 * BLOCK_SIZE + 1], k[5, 0])  # position 5: second block, offset 1
    assert torch.equal(cache.values[0][0, 4 * BLOCK_SIZE + 1], -k[9, 0])
    padding = cache.slot_mapping(np.full(10, cache.padding_slot), positions)
    assert set(padding // BLOCK_SIZE) == {cache.padding_block}  # padding writes land in the padding block only


def _scheduler(num_blocks: int, max_num_seqs: int = 4, lookahead: int = 0) -> Scheduler:
    return Scheduler(max_num_seqs, _manager(num_blocks), lookahead)


def test_admission_needs_blocks_for_the_whole_prefill_and_keeps_the_queue_order() -> None:
    scheduler = _scheduler(6, lookahead=2)
    first, second, third, small = _seq("a", 6), _seq("b", 7), _seq("c", 3), _seq("d", 1)  # 2, 3, 2, 1 blocks
    for seq in (first, second, third, small):
        scheduler.add(seq)
    assert scheduler.admit() == [first, second]
    assert len(scheduler.blocks.table(first.slot)) == 2 and len(scheduler.blocks.table(second.slot)) == 3
    assert list(scheduler.waiting) == [third, small]  # small would fit, but never overtakes the head
    assert scheduler.blocks.num_free == 1


def test_reserve_grows_tables_and_preempts_the_newest_sequences_first() -> None:
    scheduler = _scheduler(6)
    seqs = [_seq(name, 4) for name in "abc"]
    for seq in seqs:
        scheduler.add(seq)
    assert scheduler.admit() == seqs  # one block each, 3 free
    for seq in seqs:
        seq.append([1] * 4, MAX_MODEL_LEN)  # 8 tokens: two blocks each, 3 more in all
        seq.num_computed = 7
    assert scheduler.reserve() == []
    assert scheduler.blocks.num_free == 0
    for seq in seqs:
        seq.append([1], MAX_MODEL_LEN)  # 9 tokens: a third block each
    slot_c = seqs[2].slot
    preempted = scheduler.reserve()
    assert preempted == [seqs[2]]  # its two blocks let a and b grow
    assert scheduler.running == seqs[:2]
    assert all(len(scheduler.blocks.table(s.slot)) == 3 for s in seqs[:2])
    victim = seqs[2]
    assert victim.state is SeqState.WAITING and victim.slot is None and victim.num_computed == 0
    assert scheduler.blocks.table(slot_c) == []
    assert list(scheduler.waiting) == [victim]


def test_preempted_sequences_wait_first_in_their_admission_order() -> None:
    scheduler = _scheduler(5)
    seqs = [_seq(name, 4) for name in "abcd"]
    late = _seq("e", 1)
    for seq in seqs + [late]:
        scheduler.add(seq)
    assert scheduler.admit() == seqs
    seqs[0].append([1] * 11, MAX_MODEL_LEN)  # 15 tokens: four blocks, three more than it holds
    preempted = scheduler.reserve()
    assert preempted == [seqs[3], seqs[2]]
    assert list(scheduler.waiting) == [seqs[2], seqs[3], late]


def test_the_only_sequence_that_does_not_fit_preempts_itself() -> None:
    scheduler = _scheduler(4, max_num_seqs=2)
    older, newer = _seq("a", 4), _seq("b", 8)
    scheduler.add(older)
    scheduler.add(newer)
    assert scheduler.admit() == [older, newer]
    newer.append([1] * 5, MAX_MODEL_LEN)  # wants a fourth block; older holds the other
    assert scheduler.reserve() == [newer]
    assert scheduler.running == [older]
    assert scheduler.blocks.num_free == 3


def test_shared_blocks_return_to_the_pool_when_their_last_owner_frees_them() -> None:
    blocks = _manager(4)
    blocks.allocate(0, 10)  # blocks 0, 1, 2: one is left
    assert not blocks.can_allocate(1, 10) and blocks.can_allocate(1, 10, num_shared=2)
    blocks.share(1, 0, 2)
    blocks.allocate(1, 10)
    assert blocks.table(1) == [0, 1, 3] and blocks.num_used == 4
    blocks.free(0)
    assert blocks.num_used == 3 and blocks.table(1) == [0, 1, 3]  # 0 and 1 are slot 1's now
    blocks.free(1)
    assert blocks.num_used == 0
    with pytest.raises(RuntimeError):
        blocks.share(2, 1, 1)  # slot 1 holds nothing to share


def test_choices_admitted_together_share_all_but_the_block_of_the_last_prompt_token() -> None:
    scheduler = Scheduler(max_num_seqs=3, blocks=_manager(8))
    choices = [_seq("req", 9) for _ in range(3)]  # 9 tokens: 2 full blocks before the block of the last one
    for choice, seq in enumerate(choices):
        seq.choice = choice
        scheduler.add(seq)
    assert scheduler.admit() == choices
    tables = [scheduler.blocks.table(seq.slot) for seq in choices]
    assert all(table[:2] == tables[0][:2] for table in tables) and len({t[2] for t in tables}) == 3
    assert [seq.num_computed for seq in choices] == [0, 2 * BLOCK_SIZE, 2 * BLOCK_SIZE]
    assert scheduler.blocks.num_used == 5  # 3 blocks, and 1 more for each other choice


def test_dropping_lets_go_of_whole_leading_blocks_and_keeps_every_position_at_its_index() -> None:
    blocks = _manager(6)  # no home regions: freed blocks go to whoever asks next
    blocks.allocate(0, 16)
    blocks.take_changed()
    blocks.drop_before(0, 9)  # positions 0..8: block 2 holds 8, but 9..11 too
    assert blocks.table(0) == [DROPPED, DROPPED, 2, 3]
    assert blocks.take_changed() == {0: [DROPPED, DROPPED, 2, 3]}
    assert blocks.num_used == 2 and blocks.num_missing(0, 16) == 0
    blocks.drop_before(0, 5)  # behind what it let go: nothing changes
    assert blocks.take_changed() == {} and blocks.num_used == 2
    blocks.allocate(1, 8)
    assert blocks.table(1) == [0, 1]  # the dropped blocks, handed out again
    blocks.free(0)
    assert blocks.table(0) == [] and blocks.num_used == 2  # only the blocks it still held went back
    blocks.free(1)
    assert blocks.num_used == 0


def test_a_dropped_shared_block_stays_with_its_other_holder() -> None:
    blocks = _manager(4)
    blocks.allocate(0, 10)
    blocks.share(1, 0, 2)
    blocks.drop_before(0, 8)
    assert blocks.table(0) == [DROPPED, DROPPED, 2] and blocks.table(1) == [0, 1]
    assert blocks.num_used == 3
    blocks.free(1)
    assert blocks.num_used == 1


def test_dropped_table_entries_read_the_padding_block_on_every_tensor_parallel_rank() -> None:
    shape = (1, 2, MAX_MODEL_LEN, 1, 4, torch.float32, "cpu")
    leader = RecordingKVCache(*shape, block_size=BLOCK_SIZE, num_blocks=8)
    follower = KVCache(*shape, block_size=BLOCK_SIZE, num_blocks=8)
    leader.set_block_table(0, [DROPPED, DROPPED, 5])
    replay(follower, leader.take_changes())
    padding = leader.padding_block
    assert leader.block_tables[0].tolist() == follower.block_tables[0].tolist() == [padding, padding, 5, padding]


WINDOW = 4  # a sliding window for the scheduler tests: a sequence's next pass reaches num_computed - 3 at the lowest


def _window_reach(seq: Sequence) -> int:
    return seq.num_computed - WINDOW + 1


def test_reserve_drops_what_the_window_left_behind_before_growing_the_tables() -> None:
    for reach, preempted in ((None, 1), (_window_reach, 0)):
        scheduler = Scheduler(2, _manager(4), reach=reach)  # one sequence's worth of blocks
        long, short = _seq("a", 10), _seq("b", 3)
        scheduler.add(long)
        scheduler.add(short)
        assert scheduler.admit() == [long, short]  # 3 blocks and 1: the pool is full
        long.num_computed = 12
        long.append([1] * 3, MAX_MODEL_LEN)  # 13 tokens: a fourth block; positions before 9 are out of reach
        assert len(scheduler.reserve()) == preempted
    assert scheduler.blocks.table(long.slot) == [DROPPED, DROPPED, 2, 0]
    assert scheduler.running == [long, short]


def test_a_block_still_to_be_named_in_the_prefix_cache_is_not_dropped() -> None:
    blocks = BlockManager(8, BLOCK_SIZE, MAX_MODEL_LEN, caching=True)
    scheduler = Scheduler(2, blocks, reach=_window_reach)
    seq = _seq("a", 14)
    seq.cache_root = b"root"
    scheduler.add(seq)
    scheduler.admit()
    first, second = blocks.table(seq.slot)[:2]
    seq.num_computed = 14  # positions before 11 are out of reach: its first two blocks
    scheduler.reserve()
    assert blocks.table(seq.slot)[:2] == [first, second]  # neither is named yet
    seq.num_published = 1
    scheduler.reserve()
    assert blocks.table(seq.slot)[:2] == [DROPPED, second]
    with pytest.raises(RuntimeError, match="before naming"):
        blocks.publish(seq.slot, 0, [b"name"])
