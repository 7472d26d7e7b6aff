"""The cache events a worker publishes for prefix-aware routing: the names of the blocks its prefix cache stored and
evicted since its last event (vLLM's BlockStored / BlockRemoved), in one binary message.

    HEADER    32 bytes   version, flags, worker id, epoch, seq, number of stored and removed names
    STORED    DIGEST_BYTES x num_stored
    REMOVED   DIGEST_BYTES x num_removed

`epoch` is drawn when the worker starts, so a reader knows a restarted worker's cache started empty; `seq` counts
the worker's events from 0, so a reader knows when it missed one (core NATS: events are only useful live) and must
forget what it believed that worker held. An event flagged SNAPSHOT starts the worker's answer to a sync request
(subjects.cache_sync): it and the events after it store every name the worker holds, so a reader that missed
everything before (a gateway that started after the worker) replaces what it believed with them.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from shared.prefix_hash import DIGEST_BYTES, BlockHash

VERSION = 2  # 2: a flags byte (SNAPSHOT)
HEADER = struct.Struct("<HBxIQQII")
SNAPSHOT = 1  # flags: this event starts a snapshot of everything the worker holds
assert HEADER.size == 32


class CacheEventError(ValueError):
    """An event that cannot be decoded: readers count it and go on."""


@dataclass(frozen=True)
class CacheEvents:
    worker_id: int
    epoch: int
    seq: int
    stored: tuple[BlockHash, ...]
    removed: tuple[BlockHash, ...]
    snapshot: bool = False

    def encode(self) -> bytes:
        header = HEADER.pack(
            VERSION, SNAPSHOT if self.snapshot else 0, self.worker_id, self.epoch, self.seq, len(self.stored),
            len(self.removed),
        )
        return b"".join((header, *self.stored, *self.removed))

    @classmethod
    def decode(cls, data: bytes) -> CacheEvents:
        if len(data) < HEADER.size:
            raise CacheEventError(f"event of {len(data)} bytes is shorter than its {HEADER.size}-byte header")
        version, flags, worker_id, epoch, seq, num_stored, num_removed = HEADER.unpack_from(data)
        if version != VERSION:
            raise CacheEventError(f"cache event version {version}, this build reads version {VERSION}")
        if len(data) != HEADER.size + DIGEST_BYTES * (num_stored + num_removed):
            raise CacheEventError(f"event announces {num_stored + num_removed} names but has {len(data)} bytes")
        names = [
            data[start : start + DIGEST_BYTES] for start in range(HEADER.size, len(data), DIGEST_BYTES)
        ]
        return cls(
            worker_id, epoch, seq, tuple(names[:num_stored]), tuple(names[num_stored:]), bool(flags & SNAPSHOT)
        )
