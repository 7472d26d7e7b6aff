"""The names of cached KV blocks: a hash chained over a sequence's full blocks.

Block i of a sequence holds the keys and values of positions i * block_size .. (i + 1) * block_size - 1, and they
depend on every token up to the block's end, on the model and on nothing else. So block i is named by

    hash_i = H(hash_{i-1}, tokens of block i),    hash_{-1} = H(model revision, cache salt)

and two sequences whose first k block names agree hold the same first k blocks. The root folds in the model's
revision (a worker serving other weights never matches) and the request's `cache_salt` (a tenant that sets one
shares cached prompts only with requests carrying the same salt). BLAKE2b over fixed-width token bytes: stable
across processes and machines, so that names can be compared between workers and routers, and 128 bits wide,
where Python's `hash` would be neither stable nor wide enough to rule out two prompts sharing a name.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence as Seq

import numpy as np

BlockHash = bytes
DIGEST_BYTES = 16
TOKEN_BYTES = np.dtype("<i4")  # each token id of a block, as hashed


def _digest(*parts: bytes) -> BlockHash:
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))  # length-prefixed: no two part lists hash the same bytes
        h.update(part)
    return h.digest()


def root_hash(revision: str, cache_salt: str | None = None) -> BlockHash:
    """The chain's start for a model revision and an optional per-request salt."""
    return _digest(b"specmesh-prefix", revision.encode(), (cache_salt or "").encode(), bytes([cache_salt is not None]))


def cacheable_blocks(num_to_compute: int, block_size: int) -> int:
    """Leading full blocks of a sequence's `num_to_compute` positions it may take computed from elsewhere (the prefix
    cache, or the choice of its request that shares them): all but the one holding the last position, which it
    computes itself for that position's logits. Workers look up this many and gateways route on this many."""
    return max(num_to_compute - 1, 0) // block_size


def extend_hashes(hashes: list[BlockHash], root: BlockHash, token_ids: Seq[int], block_size: int) -> list[BlockHash]:
    """Appends to `hashes` (the names of the first len(hashes) blocks of token_ids) the names of the remaining full
    blocks of token_ids; returns it."""
    num_full = len(token_ids) // block_size
    if len(hashes) >= num_full:
        return hashes
    parent = hashes[-1] if hashes else root
    start = len(hashes) * block_size
    tokens = np.asarray(token_ids[start : num_full * block_size], dtype=TOKEN_BYTES).tobytes()
    width = block_size * TOKEN_BYTES.itemsize
    for offset in range(0, len(tokens), width):
        parent = _digest(parent, tokens[offset : offset + width])
        hashes.append(parent)
    return hashes
