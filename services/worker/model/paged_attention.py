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
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import use_kernel
from services.worker.engine.block_manager import blocks_for
from services.worker.engine.kv_write import BLOCK_MAJOR_DIMS
from services.worker.model.home_pass import HomePass, attend_home_pass, plan_home_pass
from services.worker.model.sequence_spans import (
    FLASH_WITH_LSE,
    GATHER_MAX_QUERY_LEN,
    Pool,
    SequenceSpan,
    plan_spans,
)

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
GATHER_MIN_SEQS = 5
GATHER_MAX_KEYS = 8192  # batch x max_context_len


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
    region (kv_cache.py), where decode or verify rows of sequences that all sit in theirs are attended in a few calls
    over views (home_pass.py); None leaves that path out. A `window` that cuts any context is attended in the batched
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
    """How the CPU attends a pass: a few calls over runs of home regions (a HomePass), one call per sequence (its
    spans), or one batched call over gathered contexts (None). `spans` may be what makes them from `group`."""
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
