"""Attention of a packed (varlen) batch against one layer's block-paged KV cache, read in place.

A step's tokens of every sequence come flattened into one [T, heads, head_dim] tensor, sequence after sequence;
sequence b owns the queries q[query_starts[b] : query_starts[b + 1]], which are the last n_b of its
context_lens[b] positions, and position x lives at key_cache[block_tables[b, x // block_size], x % block_size].
The same op serves prefill (n_b = context), decode (n_b = 1), speculative verification (n_b = K + 1) and mixed
batches of these. On CUDA it launches kernels/paged_attention.py; `paged_attention_torch` is its twin and the
CPU path, so it is written for speed on a small CPU, not only as a reference.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import use_kernel
from services.worker.engine.block_manager import blocks_for
from services.worker.engine.kv_write import BLOCK_MAJOR_DIMS

# The CPU twin has two strategies. Per sequence, a contiguous run of blocks is attended as a view of the cache,
# so no context is copied, at a fixed ~25 us of torch calls per sequence. The batched gather pays those calls once
# but copies every context once per layer (fresh pages each time), so it wins only for decode/verify batches of
# many short sequences. Measured (ms per call, best of repeats, 2 torch threads on a shared 2-core CPU; 8 heads,
# 4 kv heads, head_dim 32, block 16; decode n_b = 1 | verify n_b = 5):
#
#   batch  context    per-sequence views    batched gather
#       1       64      0.031 |  0.058      0.121 |  0.142
#       1      512      0.046 |  0.096      0.154 |  0.200
#       1     2048      0.148 |  0.257      0.257 |  0.389
#       8       64      0.228 |  0.425      0.162 |  0.297
#       8      512      0.407 |  0.806      0.382 |  0.680
#       8     2048      2.597 |  2.952      3.241 |  4.064
#      32       64      0.853 |  1.644      0.288 |  0.807
#      32      512      3.186 |  3.857      2.623 |  8.313
#      32     2048     12.394 | 15.054     34.563 | 37.495
#
# The crossover is near 5 sequences (decode and verify, contexts 64..1024) and batch x context ~8k keys.
# A prefill (B = 1, per sequence, causal flash SDPA) takes 0.1 / 2.3 / 23 ms at 64 / 512 / 2048 tokens.
GATHER_MAX_QUERY_LEN = 16  # the gather pads every sequence to the longest query run: decode/verify only
GATHER_MIN_SEQS = 5
GATHER_MAX_KEYS = 8192  # batch x max_context_len
# CPU flash attention that also returns each query's log-sum-exp [B, heads, L] (attend_after_prefix); a private
# aten op, so the masked call remains where a torch build lacks it.
FLASH_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def paged_attention(
    q: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_tables: Tensor,
    query_starts: Tensor,
    context_lens: Tensor,
    scale: float,
    max_query_len: int,
    max_context_len: int,
    first_position: int = 0,
    block_size: int | None = None,
    spans: Seq[SequenceSpan] | Callable[[int], Seq[SequenceSpan]] | None = None,
    region_len: int | None = None,
    window: int | None = None,
) -> Tensor:
    """Attention output [T, heads, head_dim] in q's dtype; the kernel on CUDA, the twin elsewhere.

    q [T, heads, head_dim]; key_cache, value_cache [num_blocks, block_size, kv_heads, head_dim], or head-major
    [kv_heads, num_blocks * block_size, head_dim] with block_size given (the CPU's layout, kv_cache.py), with this
    step's keys already written; block_tables [B, max_blocks] int32 (entries past a sequence's blocks are any valid id);
    query_starts [B + 1] int32; context_lens [B] int32. Query i of sequence b sits at position
    context_lens[b] - n_b + i and attends to positions first_position..itself (an MTP module has no entry at
    position 0); query head h reads kv head h // (heads // kv_heads). A query with no key gets zeros. q and the
    caches share a dtype; scores and softmax are float32. With a `window` (Mistral), a query at position i attends to
    positions i - window + 1..i only.
    max_query_len and max_context_len are the host-side maxima, so no call reads the device to size its work.
    """
    window = cutting_window(window, max_context_len)
    if use_kernel(q) and key_cache.dim() == BLOCK_MAJOR_DIMS:
        # Imported here: CPU callers never need triton.
        from kernels.paged_attention import paged_attention_launch

        return paged_attention_launch(
            q, key_cache, value_cache, block_tables, query_starts, context_lens, scale, max_query_len,
            max_context_len, first_position, window,
        )
    return paged_attention_torch(
        q, key_cache, value_cache, block_tables, query_starts, context_lens, scale, max_query_len, max_context_len,
        first_position, block_size, spans, region_len, window,
    )


def cutting_window(window: int | None, max_context_len: int) -> int | None:
    """The window if it cuts some context of a pass whose longest is max_context_len; None when every key is inside
    it, so that the pass takes the paths that have no window."""
    return window if window is not None and window < max_context_len else None


def paged_attention_torch(
    q: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_tables: Tensor,
    query_starts: Tensor,
    context_lens: Tensor,
    scale: float,
    max_query_len: int,
    max_context_len: int,
    first_position: int = 0,
    block_size: int | None = None,
    spans: Seq[SequenceSpan] | Callable[[int], Seq[SequenceSpan]] | None = None,
    region_len: int | None = None,
    window: int | None = None,
) -> Tensor:
    """`paged_attention` in torch ops, on any device, either cache layout: the kernel's reference and the CPU path.

    On the CPU, where reading the small index tensors costs nothing, it picks per call between attending each
    sequence over a view of the cache and one batched attention over gathered contexts. Elsewhere it always
    gathers, so that it never waits on the device. `spans`: the pass's plan_spans (or what makes them from the
    number of query heads per kv head, called only when the per-sequence path is taken), so that a layer does not
    work them out again; from the index tensors when None. `region_len`: the positions of each cache slot's home
    region (kv_cache.py), where decode or verify rows of sequences that all sit in theirs are attended in one call over
    views (attend_home_pass); None leaves that path out. A `window` that cuts any context is attended in the batched
    call, whose mask takes its lower bound.
    """
    if q.shape[0] == 0 or max_context_len <= first_position:  # no query has a key
        return torch.zeros_like(q)
    keys, values = Pool(key_cache, block_size), Pool(value_cache, block_size)
    if q.device.type == "cpu" and window is None:
        group = q.shape[1] // keys.num_kv_heads
        if spans is None:
            spans = partial(
                plan_spans, query_starts.tolist(), context_lens.tolist(),
                block_tables[:, : blocks_for(max_context_len, keys.block_size)].tolist(), keys.block_size,
                first_position, device=q.device, dtype=q.dtype,
            )
        plan = plan_cpu_attention(
            block_tables.shape[0], max_query_len, max_context_len, spans, group, region_len, keys, q.device
        )
        if isinstance(plan, HomePass):
            return attend_home_pass(q, keys, values, plan, scale)
        if plan is not None:
            return attend_per_sequence(q, keys, values, plan, scale)
    return attend_gathered(
        q, keys, values, block_tables, query_starts, context_lens, scale, max_query_len, max_context_len,
        first_position, window,
    )


def gathering_pays(num_seqs: int, max_query_len: int, max_context_len: int) -> bool:
    """Whether the CPU attends a pass's sequences in one batched call over gathered contexts (attend_gathered)
    rather than one call each over views of the cache (attend_per_sequence): see the measurements above."""
    return (
        max_query_len <= GATHER_MAX_QUERY_LEN
        and num_seqs >= GATHER_MIN_SEQS
        and num_seqs * max_context_len <= GATHER_MAX_KEYS
    )


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


def attend_per_sequence(
    q: Tensor, keys_pool: Pool, values_pool: Pool, spans: Seq[SequenceSpan], scale: float
) -> Tensor:
    """One attention call per sequence. A sequence whose blocks are one ascending run (what the block manager
    normally hands out) reads a view of the cache, no copy; any other gathers its own blocks."""
    num_kv_heads, head_dim = keys_pool.num_kv_heads, keys_pool.head_dim
    pieces: list[Tensor] = []  # the output, sequence after sequence: one concatenation instead of a write per sequence
    for span in spans:
        if span.num_blind:  # they come first, before first_position
            pieces.append(q.new_zeros(span.num_blind, *q.shape[1:]))
        if span.count == 0:
            continue
        if span.slots is None:
            keys = keys_pool.span(span.key_start, span.key_stop)[None]
            values = values_pool.span(span.key_start, span.key_stop)[None]
        else:
            keys, values = keys_pool.gather(span.slots), values_pool.gather(span.slots)
        # keys, values [1, kv_heads, visible, head_dim]: 4-d, because CPU SDPA takes its flash path only for 4-d
        queries = q[span.end - span.count : span.end]
        if span.count == 1:
            # One query sees every visible key, so no mask; its heads that share a kv head become rows of one
            # matrix, which needs no GQA expansion.
            grouped = queries.reshape(1, num_kv_heads, -1, head_dim)
            attended = F.scaled_dot_product_attention(grouped, keys, values, scale=scale)
            pieces.append(attended.reshape(1, -1, head_dim))
            continue
        if span.piece:
            pieces.append(attend_after_prefix(queries, keys, values, scale))
            continue
        if span.mask is not None:
            # Verify rows: as for one query, the heads sharing a kv head become rows of one matrix (kv head, head
            # in group, query), which spares SDPA's GQA path (~20% of the call at a 2k context).
            count, group = span.count, q.shape[1] // num_kv_heads
            grouped = queries.view(count, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
            attended = F.scaled_dot_product_attention(
                grouped.reshape(1, num_kv_heads, group * count, head_dim), keys, values, attn_mask=span.mask,
                scale=scale,
            )
            by_query = attended.view(num_kv_heads, group, count, head_dim).permute(2, 0, 1, 3)
            pieces.append(by_query.reshape(count, -1, head_dim))
            continue
        attended = F.scaled_dot_product_attention(
            queries.transpose(0, 1)[None], keys, values, is_causal=span.causal, scale=scale, enable_gqa=True,
        )
        pieces.append(attended[0].transpose(0, 1))
    return pieces[0].contiguous() if len(pieces) == 1 else torch.cat(pieces)


def attend_after_prefix(queries: Tensor, keys: Tensor, values: Tensor, scale: float) -> Tensor:
    """queries [count, heads, head_dim], the last `count` of the positions of keys and values [1, kv_heads, visible,
    head_dim]: each sees every earlier position, the prefix whole and the piece's own keys up to its own. Two flash
    calls, the prefix unmasked and the piece causal, merged by their log-sum-exps: one masked call would take the
    CPU's math path over the whole rectangle, ~1.5x slower for a 512-token piece after 1,400 tokens (4 heads'
    worth of keys, 1 thread). Equal to the masked call up to float32 summation order (~2e-7)."""
    count, num_heads, head_dim = queries.shape
    num_kv_heads, visible = keys.shape[1], keys.shape[2]
    group, prefix = num_heads // num_kv_heads, visible - count
    by_head = queries.transpose(0, 1)  # [heads, count, head_dim]
    # The prefix part: the heads sharing a kv head as rows of one matrix, so the keys need no expansion.
    grouped = by_head.reshape(1, num_kv_heads, group * count, head_dim)
    before, before_lse = FLASH_WITH_LSE(grouped, keys[:, :, :prefix], values[:, :, :prefix], scale=scale)
    own_keys = keys[:, :, prefix:].repeat_interleave(group, 1)  # [1, heads, count, head_dim]: the piece's own
    own_values = values[:, :, prefix:].repeat_interleave(group, 1)
    own, own_lse = FLASH_WITH_LSE(by_head[None], own_keys, own_values, is_causal=True, scale=scale)
    before, before_lse = before.reshape(1, num_heads, count, head_dim), before_lse.reshape(1, num_heads, count)
    top = torch.maximum(before_lse, own_lse)
    before_weight, own_weight = (before_lse - top).exp_(), (own_lse - top).exp_()
    merged = (before * before_weight[..., None] + own * own_weight[..., None]) / (before_weight + own_weight)[..., None]
    return merged[0].transpose(0, 1).to(queries.dtype)  # the log-sum-exps are float32 whatever q's dtype


@dataclass(frozen=True)
class HomePass:
    """A pass of short query runs (decode or verify rows, at most GATHER_MAX_QUERY_LEN a sequence) whose sequences
    all read their context from the start of a home region of the cache (a run of region_len positions that the
    block manager gives each slot by default): regions first_region .. first_region + num_regions - 1 viewed as one
    batch, with no copy, each region's queries padded to queries_per_region."""

    first_region: int
    num_regions: int
    region_len: int
    queries_per_region: int
    # [T] each packed token's row among the padded ones (region-major); None when that is the identity (one query
    # per sequence, regions in order)
    token_rows: Tensor | None
    mask: Tensor  # [num_regions, 1, group * queries_per_region, max_context] additive, rows head-in-group major
    max_context: int


def plan_home_pass(
    spans: Seq[SequenceSpan], region_len: int, num_positions: int, group: int, device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> HomePass | None:
    """The one-call plan for a pass, or None when a sequence does not start a home region, has more than
    GATHER_MAX_QUERY_LEN queries or queries that see no key, or the regions between them are mostly idle (each idle
    one is attended to and thrown away)."""
    if any(
        s.num_blind or s.slots is not None or s.key_start % region_len or not 0 < s.count <= GATHER_MAX_QUERY_LEN
        for s in spans
    ):
        return None
    regions = [s.key_start // region_len for s in spans]
    first, last = min(regions), max(regions)
    num_regions = last - first + 1
    if num_regions > 2 * len(spans) or (last + 1) * region_len > num_positions:
        return None
    per_region = max(s.count for s in spans)
    # Query i of a region sees keys up to its own position; padding rows and idle regions see key 0 alone, so
    # their discarded rows stay finite.
    limits = [[0] * per_region for _ in range(num_regions)]
    token_rows = []
    for region, span in zip(regions, spans):
        context, row = span.key_stop - span.key_start, (region - first) * per_region
        limits[region - first][: span.count] = range(context - span.count, context)
        token_rows.extend(range(row, row + span.count))
    max_context = max(span.key_stop - span.key_start for span in spans)
    visible = torch.arange(max_context, device=device) <= torch.tensor(limits, device=device)[:, :, None]
    mask = additive_mask(visible[:, None].expand(num_regions, group, per_region, max_context), dtype)
    mask = mask.view(num_regions, 1, -1, max_context)
    identity = token_rows == list(range(num_regions * per_region))
    return HomePass(
        first, num_regions, region_len, per_region,
        None if identity else torch.tensor(token_rows, device=device), mask, max_context,
    )


def plan_cpu_attention(
    num_seqs: int,
    max_query_len: int,
    max_context_len: int,
    spans: Seq[SequenceSpan] | Callable[[int], Seq[SequenceSpan]],
    group: int,
    region_len: int | None,
    keys: Pool,
    device: torch.device,
) -> HomePass | Seq[SequenceSpan] | None:
    """How the CPU attends a pass: one call over home regions (a HomePass), one call per sequence (its spans), or
    one batched call over gathered contexts (None). `spans` may be what makes them from `group`."""
    short_runs = (
        max_query_len <= GATHER_MAX_QUERY_LEN and num_seqs > 1 and region_len is not None and not keys.block_major
    )
    if not short_runs and gathering_pays(num_seqs, max_query_len, max_context_len):
        return None
    planned = spans(group) if callable(spans) else spans
    if short_runs:
        home = plan_home_pass(planned, region_len, keys.flat.shape[1], group, device, keys.flat.dtype)
        if home is not None:
            return home
        if gathering_pays(num_seqs, max_query_len, max_context_len):
            return None
    return planned


def attend_home_pass(q: Tensor, keys_pool: Pool, values_pool: Pool, plan: HomePass, scale: float) -> Tensor:
    """attend_per_sequence's result for a HomePass, in one SDPA call over views of the head-major cache:
    [regions, kv_heads, context, head_dim], each region's queries of the heads sharing a kv head as rows of one
    matrix, each query's keys past its position masked. Equal to the per-sequence path up to float32 summation
    order."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, per_region = keys_pool.num_kv_heads, plan.queries_per_region
    group = num_heads // num_kv_heads
    start = plan.first_region * plan.region_len
    stop = start + plan.num_regions * plan.region_len

    def regions(pool: Pool) -> Tensor:
        by_region = pool.flat[:, start:stop].view(num_kv_heads, plan.num_regions, plan.region_len, head_dim)
        return by_region[:, :, : plan.max_context].transpose(0, 1)

    padded = q
    if plan.token_rows is not None:
        padded = q.new_zeros(plan.num_regions * per_region, num_heads, head_dim).index_copy_(0, plan.token_rows, q)
    grouped = padded.view(plan.num_regions, per_region, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    attended = F.scaled_dot_product_attention(
        grouped.reshape(plan.num_regions, num_kv_heads, group * per_region, head_dim), regions(keys_pool),
        regions(values_pool), attn_mask=plan.mask, scale=scale,
    )
    by_row = attended.view(plan.num_regions, num_kv_heads, group, per_region, head_dim).permute(0, 3, 1, 2, 4)
    out = by_row.reshape(plan.num_regions * per_region, num_heads, head_dim)
    return out if plan.token_rows is None else out.index_select(0, plan.token_rows)


def attend_gathered(
    q: Tensor,
    keys_pool: Pool,
    values_pool: Pool,
    block_tables: Tensor,
    query_starts: Tensor,
    context_lens: Tensor,
    scale: float,
    max_query_len: int,
    max_context_len: int,
    first_position: int,
    window: int | None = None,
) -> Tensor:
    """One batched attention over every sequence's gathered context [B, max_context_len, kv_heads, head_dim],
    queries padded to max_query_len, mask built on q's device (with a `window`, each query sees only the last `window`
    positions up to its own). Never reads a device tensor on the host."""
    tokens, num_heads, head_dim = q.shape
    batch = block_tables.shape[0]
    device = q.device
    num_blocks = blocks_for(max_context_len, keys_pool.block_size)
    # [B, C]: the flat slots of the C positions from first_position to the longest context
    slots = keys_pool.block_slots(block_tables[:, :num_blocks])[:, first_position:max_context_len]
    keys, values = keys_pool.gather(slots), values_pool.gather(slots)  # [B, kv_heads, C, head_dim]

    starts = query_starts[:-1].long()
    counts = query_starts[1:].long() - starts
    offsets = torch.arange(max_query_len, device=device)
    # Padding rows (offset >= count) read some real query and are dropped below.
    rows = (starts[:, None] + offsets).clamp_(max=tokens - 1)  # [B, Lq]
    queries = q.index_select(0, rows.view(-1)).view(batch, max_query_len, num_heads, head_dim).transpose(1, 2)
    positions = (context_lens.long() - counts)[:, None] + offsets  # [B, Lq]
    key_positions = torch.arange(first_position, max_context_len, device=device)
    mask = key_positions <= positions[:, None, :, None]  # [B, 1, Lq, C]; also hides keys past each context
    if window is not None:
        mask &= key_positions > positions[:, None, :, None] - window
    attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)

    # Token t of sequence s is row s * Lq + (t - start_s) of the padded output.
    sequence = torch.repeat_interleave(torch.arange(batch, device=device), counts, output_size=tokens)
    token_rows = sequence * max_query_len + torch.arange(tokens, device=device) - starts[sequence]
    out = attended.transpose(1, 2).reshape(batch * max_query_len, num_heads, head_dim).index_select(0, token_rows)
    # A query before first_position has no key: its fully masked row is not defined by SDPA, so it is zeroed.
    has_key = positions.view(-1).index_select(0, token_rows) >= first_position
    return torch.where(has_key[:, None, None], out, 0)
