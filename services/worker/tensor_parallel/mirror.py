"""What the leader tells its followers, so that every rank runs the same pass on its shard.

The engine runs on the leader alone; its followers hold no scheduler. Every runner call that touches the model or
the KV cache is sent to them first, as one message down a pipe (an op and its plain arguments): the pass's rows,
or the shape of a tensor argument, which then follows by broadcast over the group. Block-table changes and block
copies ride along with the next pass that reads them, so bookkeeping costs no message of its own.

Messages go by pipe, not by collective, because a follower waits for the next one for as long as the engine idles,
and a collective would time out.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from services.worker.engine.kv_cache import KVCache


class Op(Enum):
    FORWARD = "forward"  # (changes, rows, starts, slots)
    LOGITS = "logits"  # (shape, dtype), the hidden states broadcast after
    MTP_FORWARD = "mtp_forward"  # (changes, index, shape, dtype, rows, starts, slots), the hidden states after
    MTP_LOGITS = "mtp_logits"  # (index, shape, dtype), the hidden states after
    READ_BLOCKS = "read_blocks"  # (changes, blocks): each rank's heads of them gathered on the leader
    WRITE_BLOCKS = "write_blocks"  # (changes, blocks, shape, dtype), the unsplit blocks broadcast after
    STOP = "stop"  # ()


class Change(Enum):
    TABLE = "table"  # (slot, blocks)
    COPY = "copy"  # (copies,)


class RecordingKVCache(KVCache):
    """The leader's KV cache: applies each block-table change and block copy, and keeps it for the followers."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._changes: list[tuple] = []

    def set_block_table(self, slot: int, blocks: list[int]) -> None:
        super().set_block_table(slot, blocks)
        self._changes.append((Change.TABLE, slot, list(blocks)))

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            super().copy_blocks(copies)
            self._changes.append((Change.COPY, list(copies)))

    def take_changes(self) -> list[tuple]:
        """The changes since the last call, in order."""
        changes, self._changes = self._changes, []
        return changes


def replay(cache: KVCache, changes: list[tuple]) -> None:
    """A follower's cache made to match the leader's before a pass."""
    for kind, *args in changes:
        if kind is Change.TABLE:
            cache.set_block_table(*args)
        else:
            cache.copy_blocks(*args)
