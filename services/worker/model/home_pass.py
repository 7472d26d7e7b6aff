"""Decode and verify rows attended over their slots' home regions of the cache, a few SDPA calls for a whole pass.

By default the block manager gives each slot a home region of region_len positions (kv_cache.py), and a running
sequence reads its context from that region's start. A pass whose sequences all sit in theirs is attended as runs of
neighbouring regions: each run is one batch of views [regions, kv_heads, context, head_dim] with no copy, every
region's queries padded to the run's longest query run and its keys to the run's longest context, masked past their
own positions. An idle region inside a run, and the padding, are attended and thrown away, while a call of its own
costs a region about what attending ~200 more keys does; so a region joins the run before it only where that is
the cheaper of the two (partition_runs, by run_cost).

Measured in-process under unique-prompt churn (32 requests in flight over 64 slots, 128-token prompts, 64-192
output tokens, T=1, one thread): one call from the lowest busy region to the highest attended 1.7 regions a
sequence; runs split at idle stretches attended 1.56x the keys x queries the sequences need, in 7 calls a pass;
these runs 1.26x, in 10 calls, with 5% less time in attention (4.04 s against 4.27 s over the same requests).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from services.worker.model.sequence_spans import GATHER_MAX_QUERY_LEN, Pool, SequenceSpan, additive_mask

# A run's time, in units of one key read for one query row (run_cost): measured with the demo model's shape (4 kv
# heads, 2 query heads each, head_dim 32; one thread), a call ~10 us on top of its regions, a region ~16 / 29 / 52 us
# at 160 / 320 / 1,024 keys with one query and 1.3-2x that with four.
CALL_COST = 1400  # one SDPA call's fixed cost, with the views around it
MASK_COST = 400  # a run of several regions builds its mask once a pass (a layer's share of it)
KEY_COST_IN_ROWS = 4  # streaming a key and its value costs about as much as 4 query rows attending it


@dataclass(frozen=True)
class RegionRun:
    """Neighbouring home regions first_region .. first_region + num_regions - 1, attended in one call."""

    first_region: int
    num_regions: int
    queries_per_region: int
    first_row: int  # its first row among the pass's padded rows (runs in region order, regions in order within)
    max_context: int
    # [num_regions, 1, group * queries_per_region, max_context] additive, rows head-in-group major; None for one
    # region's one query, which sees every key
    mask: Tensor | None

    @property
    def num_rows(self) -> int:
        return self.num_regions * self.queries_per_region


@dataclass(frozen=True)
class HomePass:
    """A pass of short query runs (at most GATHER_MAX_QUERY_LEN a sequence) of sequences that all read their
    context from the start of a home region: its runs of regions and where each packed token sits among them."""

    region_len: int
    runs: tuple[RegionRun, ...]
    num_rows: int  # padded rows, every run's in turn
    # [T] each packed token's row among the padded ones; None when that is the identity (one run, one query per
    # sequence, regions in order with no idle one)
    token_rows: Tensor | None


def plan_home_pass(
    spans: Seq[SequenceSpan], region_len: int, num_positions: int, group: int, device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> HomePass | None:
    """The plan of a pass, or None when a sequence does not start a home region, has more than GATHER_MAX_QUERY_LEN
    queries or queries that see no key, or its region runs past the cache's positions, or two sequences read from
    the start of one region (the block manager gives each slot its own; this keeps the plan right without it)."""
    if any(
        s.num_blind or s.slots is not None or s.key_start % region_len or not 0 < s.count <= GATHER_MAX_QUERY_LEN
        for s in spans
    ):
        return None
    by_region = sorted((s.key_start // region_len, i) for i, s in enumerate(spans))
    if (by_region[-1][0] + 1) * region_len > num_positions:
        return None
    if any(a[0] == b[0] for a, b in zip(by_region, by_region[1:])):  # a region holds one sequence's queries
        return None
    bounds = partition_runs(
        [region for region, _ in by_region], [spans[i].key_stop - spans[i].key_start for _, i in by_region],
        [spans[i].count for _, i in by_region],
    )
    groups = [by_region[start:stop] for start, stop in zip(bounds, bounds[1:])]
    runs, token_rows, first_row = [], [0] * len(spans), 0
    for members in groups:
        run = _plan_run(members, spans, first_row, group, token_rows, device, dtype)
        runs.append(run)
        first_row += run.num_rows
    identity = len(runs) == 1 and token_rows == list(range(first_row))
    return HomePass(region_len, tuple(runs), first_row, None if identity else _rows_tensor(spans, token_rows, device))


def run_cost(num_regions: int, max_context: int, queries_per_region: int, num_members: int) -> int:
    """The estimated time of one run's call per layer, in key-rows (one key read for one query row)."""
    mask = MASK_COST if num_members > 1 else 0
    return CALL_COST + mask + num_regions * max_context * (KEY_COST_IN_ROWS + queries_per_region)


def partition_runs(regions: list[int], contexts: list[int], counts: list[int]) -> list[int]:
    """Busy regions in ascending order, each sequence's context and query count -> the bounds [0, .., n] of the
    runs (members bounds[r] .. bounds[r + 1] - 1): left to right, a member joins the run before it when that costs
    less (run_cost) than a call of its own."""
    bounds = [0]
    first, longest, widest = regions[0], contexts[0], counts[0]
    cost = run_cost(1, longest, widest, 1)
    for i in range(1, len(regions)):
        joined_longest, joined_widest = max(longest, contexts[i]), max(widest, counts[i])
        joined = run_cost(regions[i] - first + 1, joined_longest, joined_widest, i - bounds[-1] + 1)
        alone = run_cost(1, contexts[i], counts[i], 1)
        if joined <= cost + alone:
            longest, widest, cost = joined_longest, joined_widest, joined
        else:
            bounds.append(i)
            first, longest, widest, cost = regions[i], contexts[i], counts[i], alone
    bounds.append(len(regions))
    return bounds


def _plan_run(
    members: list[tuple[int, int]], spans: Seq[SequenceSpan], first_row: int, group: int, token_rows: list[int],
    device: torch.device, dtype: torch.dtype,
) -> RegionRun:
    """One run's masks, its members' (region, span index) in region order; fills their spans' first rows into
    token_rows (by span index)."""
    first, last = members[0][0], members[-1][0]
    num_regions = last - first + 1
    per_region = max(spans[i].count for _, i in members)
    max_context = max(spans[i].key_stop - spans[i].key_start for _, i in members)
    if len(members) == 1:
        span = spans[members[0][1]]
        token_rows[members[0][1]] = first_row
        if span.count == 1:  # one query sees every key: no mask
            return RegionRun(first, 1, 1, first_row, max_context, None)
        if span.mask is not None:  # the last `count` positions, plan_spans's mask
            return RegionRun(first, 1, span.count, first_row, max_context, span.mask.view(1, 1, -1, max_context))
    # Query i of a region sees keys up to its own position; padding rows and idle regions see key 0 alone, so
    # their discarded rows stay finite.
    limits = [[0] * per_region for _ in range(num_regions)]
    for region, i in members:
        span = spans[i]
        context = span.key_stop - span.key_start
        limits[region - first][: span.count] = range(context - span.count, context)
        token_rows[i] = first_row + (region - first) * per_region
    visible = torch.arange(max_context, device=device) <= torch.tensor(limits, device=device)[:, :, None]
    mask = additive_mask(visible[:, None].expand(num_regions, group, per_region, max_context), dtype)
    return RegionRun(first, num_regions, per_region, first_row, max_context, mask.view(num_regions, 1, -1, max_context))


def _rows_tensor(spans: Seq[SequenceSpan], first_rows: list[int], device: torch.device) -> Tensor:
    """[T] the padded row of every packed token: span i's queries are rows end - count .. end - 1 of q."""
    rows = [0] * sum(s.count for s in spans)
    for span, first in zip(spans, first_rows):
        rows[span.end - span.count : span.end] = range(first, first + span.count)
    return torch.tensor(rows, device=device)


def attend_home_pass(q: Tensor, keys_pool: Pool, values_pool: Pool, plan: HomePass, scale: float) -> Tensor:
    """q [T, heads, head_dim] -> attention [T, heads, head_dim] as one call per sequence gives it (up to float32
    summation order): per run, the heads sharing a kv head as rows of one matrix, over views of the head-major
    cache."""
    _, num_heads, head_dim = q.shape
    num_kv_heads = keys_pool.num_kv_heads
    group = num_heads // num_kv_heads
    padded = q
    if plan.token_rows is not None:
        padded = q.new_zeros(plan.num_rows, num_heads, head_dim).index_copy_(0, plan.token_rows, q)
    pieces = []
    for run in plan.runs:
        start = run.first_region * plan.region_len
        stop = start + run.num_regions * plan.region_len

        def regions(pool: Pool) -> Tensor:
            by_region = pool.flat[:, start:stop].view(num_kv_heads, run.num_regions, plan.region_len, head_dim)
            return by_region[:, :, : run.max_context].transpose(0, 1)  # [regions, kv_heads, context, head_dim]

        rows = padded.narrow(0, run.first_row, run.num_rows)
        per_region = run.queries_per_region
        grouped = rows.view(run.num_regions, per_region, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
        attended = F.scaled_dot_product_attention(
            grouped.reshape(run.num_regions, num_kv_heads, group * per_region, head_dim), regions(keys_pool),
            regions(values_pool), attn_mask=run.mask, scale=scale,
        )
        by_row = attended.view(run.num_regions, num_kv_heads, group, per_region, head_dim).permute(0, 3, 1, 2, 4)
        pieces.append(by_row.reshape(run.num_rows, num_heads, head_dim))
    out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    return out if plan.token_rows is None else out.index_select(0, plan.token_rows)
