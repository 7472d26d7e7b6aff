"""Decode and verify rows attended over their slots' home regions of the cache, a few SDPA calls for a whole pass.

By default the block manager gives each slot a home region of region_len positions (kv_cache.py), and a running
sequence reads its context from that region's start. A pass whose sequences all sit in theirs is attended as runs of
neighbouring regions: each run is one batch of views [regions, kv_heads, context, head_dim] with no copy, every
region's queries padded to the run's longest query run and masked past their own positions. An idle region inside a
run is attended and thrown away; a run ends where more than MAX_IDLE_REGIONS idle ones follow, since one more call
costs about what attending one or two regions does (demo-model shape, one thread: a call ~5-10 us, a region ~5 us
at 160 keys and ~17 us at 320 keys with 4 queries). Slots spread over the cache, as 32 running sequences over 64
slots' regions are under churn, then cost their own regions and the few holes between them, not every region from
the lowest to the highest.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from services.worker.model.sequence_spans import GATHER_MAX_QUERY_LEN, Pool, SequenceSpan, additive_mask

MAX_IDLE_REGIONS = 1  # idle regions a run may hold between two busy ones


@dataclass(frozen=True)
class RegionRun:
    """Neighbouring home regions first_region .. first_region + num_regions - 1, attended in one call."""

    first_region: int
    num_regions: int
    queries_per_region: int
    first_row: int  # its first row among the pass's padded rows (runs in region order, regions in order within)
    max_context: int
    mask: Tensor  # [num_regions, 1, group * queries_per_region, max_context] additive, rows head-in-group major

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
    queries or queries that see no key, or its region runs past the cache's positions."""
    if any(
        s.num_blind or s.slots is not None or s.key_start % region_len or not 0 < s.count <= GATHER_MAX_QUERY_LEN
        for s in spans
    ):
        return None
    by_region = sorted((s.key_start // region_len, i) for i, s in enumerate(spans))
    if (by_region[-1][0] + 1) * region_len > num_positions:
        return None
    groups: list[list[tuple[int, int]]] = [[by_region[0]]]
    for entry in by_region[1:]:
        if entry[0] - groups[-1][-1][0] - 1 > MAX_IDLE_REGIONS:
            groups.append([])
        groups[-1].append(entry)
    runs, token_rows, first_row = [], [0] * len(spans), 0
    for members in groups:
        run = _plan_run(members, spans, first_row, group, token_rows, device, dtype)
        runs.append(run)
        first_row += run.num_rows
    identity = len(runs) == 1 and token_rows == list(range(first_row))
    return HomePass(region_len, tuple(runs), first_row, None if identity else _rows_tensor(spans, token_rows, device))


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
    num_tokens, num_heads, head_dim = q.shape
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
