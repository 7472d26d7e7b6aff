"""How each sequence of a pass reads one layer's block-paged KV cache on the CPU: the cache read by position in either
layout (Pool), and per sequence its queries, its keys (a view of the cache when its blocks are one ascending run,
gathered slots otherwise) and its mask (SequenceSpan), worked out once per pass from host-side integers
(plan_spans) and read by every layer."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
from torch import Tensor

from services.worker.engine.block_manager import blocks_for
from services.worker.engine.kv_write import BLOCK_MAJOR_DIMS

GATHER_MAX_QUERY_LEN = 16  # the gather pads every sequence to the longest query run: decode/verify only
# CPU flash attention that also returns each query's log-sum-exp [B, heads, L] (attend_after_prefix); a private
# aten op, so the masked call remains where a torch build lacks it.
FLASH_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)



class Pool:
    """One layer's key or value cache read by position, in either layout; every read gives [.., kv_heads, n,
    head_dim], the layout attention takes."""

    def __init__(self, cache: Tensor, block_size: int | None) -> None:
        self.block_major = cache.dim() == BLOCK_MAJOR_DIMS
        if self.block_major:
            self.block_size, self.num_kv_heads, self.head_dim = cache.shape[1:]
            self.flat = cache.view(-1, self.num_kv_heads, self.head_dim)  # [positions, kv_heads, head_dim]
        else:
            if block_size is None:
                raise ValueError("a head-major cache [kv_heads, positions, head_dim] needs its block_size")
            self.num_kv_heads, _, self.head_dim = cache.shape
            self.block_size = block_size
            self.flat = cache  # [kv_heads, positions, head_dim]

    def span(self, start: int, stop: int) -> Tensor:
        """Flat slots start..stop - 1: [kv_heads, n, head_dim], a view."""
        return self.flat[start:stop].transpose(0, 1) if self.block_major else self.flat[:, start:stop]

    def gather(self, slots: Tensor) -> Tensor:
        """slots [B, n] flat slots -> [B, kv_heads, n, head_dim] (copied)."""
        batch, n = slots.shape
        if self.block_major:
            return self.flat.index_select(0, slots.reshape(-1)).view(batch, n, -1, self.head_dim).transpose(1, 2)
        return self.flat.index_select(1, slots.reshape(-1)).view(-1, batch, n, self.head_dim).transpose(0, 1)

    def block_slots(self, blocks: Tensor) -> Tensor:
        """blocks [..., m] -> the flat slots of their positions [..., m * block_size], in position order."""
        return block_slots(blocks, self.block_size)


def block_slots(blocks: Tensor, block_size: int) -> Tensor:
    """blocks [..., m] -> the flat slots of their positions [..., m * block_size], in position order."""
    offsets = torch.arange(block_size, device=blocks.device)
    return (blocks.long()[..., None] * block_size + offsets).flatten(-2)


@dataclass(frozen=True)
class SequenceSpan:
    """One sequence's queries and keys in a pass, as the CPU's per-sequence attention reads them. Worked out once
    per pass (plan_spans) and read by every layer, since only the cache contents differ between layers."""

    end: int  # its queries are rows end - count .. end - 1 of q, after num_blind rows that see no key
    count: int
    num_blind: int  # queries before first_position (an MTP module has no key at position 0): zeros
    key_start: int  # its keys are the flat slots key_start .. key_stop - 1, when its blocks are one ascending run
    key_stop: int
    slots: Tensor | None  # [1, visible] flat slots otherwise, gathered
    # [group * count, visible] additive (0 or -inf) for queries that are the last `count` of more positions, row
    # g * count + i for query i's head g of each kv head (attend_per_sequence makes those heads rows of one matrix)
    mask: Tensor | None
    causal: bool  # every visible position is a query (prefill)
    # A prompt piece after earlier positions (chunked prefill, or past a cached prefix): its queries are the last
    # `count` positions and there are more than GATHER_MAX_QUERY_LEN of them; attended by attend_after_prefix
    piece: bool = False


def additive_mask(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """A bool mask -> SDPA's additive form, 0 where allowed and -inf elsewhere. Made once per pass: SDPA converts
    a bool mask in every call, one per layer, which cost a demo-model verify pass ~25 us."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def plan_spans(
    query_starts: Seq[int],
    context_lens: Seq[int],
    block_rows: Seq[Seq[int]],
    block_size: int,
    first_position: int,
    group: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> list[SequenceSpan]:
    """The spans of a pass from its host-side integers: query offsets [B + 1], context lengths [B] and each
    sequence's blocks (at least those its context covers); `group` query heads share each kv head; masks in the
    queries' `dtype`."""
    spans = []
    for b, context in enumerate(context_lens):
        end = query_starts[b + 1]
        num_queries = end - query_starts[b]
        visible = context - first_position  # keys at positions first_position..context - 1
        count = max(min(num_queries, visible), 0)  # the queries that see at least one key
        key_start = key_stop = 0
        slots = mask = None
        piece = False
        if count:
            blocks = list(block_rows[b][: blocks_for(context, block_size)])
            if blocks == list(range(blocks[0], blocks[0] + len(blocks))):  # position x of the run: s * bs + x
                key_start = blocks[0] * block_size + first_position
                key_stop = blocks[0] * block_size + context
            else:
                slots = block_slots(torch.tensor(blocks, device=device), block_size)[None, first_position:context]
            piece = GATHER_MAX_QUERY_LEN < count < visible and FLASH_WITH_LSE is not None
            if 1 < count < visible and not piece:  # the last `count` positions: causal, diagonal moved right
                lower = torch.ones(count, visible, dtype=torch.bool, device=device).tril_(visible - count)
                mask = additive_mask(lower.expand(group, count, visible), dtype).view(group * count, visible)
        spans.append(SequenceSpan(
            end, count, num_queries - count, key_start, key_stop, slots, mask, causal=1 < count == visible,
            piece=piece,
        ))
    return spans
