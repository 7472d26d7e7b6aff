"""Paged attention: a packed (varlen) batch of queries against one layer's block-paged KV cache, read in place.
Twin: services/worker/model/paged_attention.paged_attention_torch (equal up to float32 summation order).

Layout: q is [T, heads, head_dim], sequence after sequence (query_starts); the caches are
[num_blocks, block_size, kv_heads, head_dim] and position x of sequence b lives in block block_tables[b, x // bs]
at offset x % bs. One program per (query tile, sequence, kv head). Its rows are (query, head) pairs: the query
heads that share the kv head, for QUERIES_PER_TILE consecutive queries, so each key block is loaded once per kv
head however many query heads read it (a decode or verify step has few queries, and its tile is filled by heads;
a prefill's tile by queries). The program walks the sequence's block table from first_position up to its last
query's block, one block of BLOCK_SIZE keys per iteration, with a flash-attention online softmax in float32
(exp2, the scale folded with log2 e), so the context is never gathered and nothing is allocated per step.
A query whose position is before first_position sees no key and is written as zeros. With a window (Mistral's
sliding window), a query at position i sees keys i - window < j <= i only, and the program starts its walk at the
first block its earliest query's window reaches.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

MIN_DOT = 16  # tl.dot's smallest tile side: rows, key block and head_dim are padded up to it
MAX_TILE_ROWS = 64  # (query, head) rows per program: a prefill's tile; decode/verify use the smallest that fits
NUM_WARPS = 4
# Running-max start: finite, so a row that has seen only masked keys rescales by exp2(0) instead of NaN.
SCORE_FLOOR = tl.constexpr(-1.0e30)
NO_WINDOW = 2**30  # the window of a model without one: beyond any context


@triton.jit
def _dot(a, b, WIDEN: tl.constexpr, PRECISION: tl.constexpr):
    """tl.dot, on operands widened to float32 when WIDEN: Triton's interpreter multiplies the bit patterns of
    bfloat16 operands (triton-lang/triton#11584, "not supported yet"). Widening is exact, so the products and
    their float32 sums are those of the GPU's bfloat16 dot."""
    if WIDEN:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [T, heads, head_dim], head_dim contiguous (a slice of a fused qkv projection is read in place)
    key_ptr,  # [num_blocks, block_size, kv_heads, head_dim], contiguous
    value_ptr,  # same
    out_ptr,  # [T, heads, head_dim], contiguous
    block_tables_ptr,  # [B, max_blocks] int32
    query_starts_ptr,  # [B + 1] int32
    context_lens_ptr,  # [B] int32
    scale_log2,  # softmax scale * log2(e)
    first_position,
    window,  # a query at position i sees keys i - window < j <= i (NO_WINDOW: every earlier key)
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    stride_table,
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_PADDED: tl.constexpr,  # GROUP rounded up to a power of two (tl.arange needs one)
    QUERIES_PER_TILE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WIDEN_DOT: tl.constexpr,
):
    tile = tl.program_id(0)
    sequence = tl.program_id(1)
    kv_head = tl.program_id(2)
    query_start = tl.load(query_starts_ptr + sequence)
    count = tl.load(query_starts_ptr + sequence + 1) - query_start
    first_query = tile * QUERIES_PER_TILE
    if first_query >= count:  # the grid is sized for the longest query run
        return
    context = tl.load(context_lens_ptr + sequence)

    rows = tl.arange(0, QUERIES_PER_TILE * GROUP_PADDED)
    query = first_query + rows // GROUP_PADDED  # index within the sequence's queries
    head_in_group = rows % GROUP_PADDED
    row_valid = (query < count) & (head_in_group < GROUP)
    head = kv_head * GROUP + head_in_group
    position = context - count + query  # [ROWS]
    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_valid = dims < HEAD_DIM
    token = (query_start + query).to(tl.int64)  # [ROWS]
    io_mask = row_valid[:, None] & dim_valid[None, :]
    q_rows = token * stride_q_token + head * stride_q_head
    q = tl.load(q_ptr + q_rows[:, None] + dims[None, :], mask=io_mask, other=0.0)  # [ROWS, HEAD_DIM_PADDED]

    running_max = tl.full((QUERIES_PER_TILE * GROUP_PADDED,), SCORE_FLOOR, tl.float32)
    running_sum = tl.zeros((QUERIES_PER_TILE * GROUP_PADDED,), tl.float32)
    acc = tl.zeros((QUERIES_PER_TILE * GROUP_PADDED, HEAD_DIM_PADDED), tl.float32)

    # Keys from first_position up to the tile's last query: later blocks are causally masked for every row.
    last_position = context - count + tl.minimum(first_query + QUERIES_PER_TILE, count) - 1
    offsets = tl.arange(0, BLOCK_SIZE)
    table_row = block_tables_ptr + sequence.to(tl.int64) * stride_table
    first_key = tl.maximum(first_position, context - count + first_query - window + 1)
    for logical_block in range(first_key // BLOCK_SIZE, last_position // BLOCK_SIZE + 1):
        block = tl.load(table_row + logical_block).to(tl.int64)
        block_base = block * stride_cache_block + kv_head * stride_cache_head
        token_offsets = offsets * stride_cache_token
        keys = tl.load(  # [HEAD_DIM_PADDED, BLOCK_SIZE]: transposed for q @ k^T
            key_ptr + block_base + token_offsets[None, :] + dims[:, None], mask=dim_valid[:, None], other=0.0
        )
        values = tl.load(  # [BLOCK_SIZE, HEAD_DIM_PADDED]
            value_ptr + block_base + token_offsets[:, None] + dims[None, :], mask=dim_valid[None, :], other=0.0
        )
        scores = _dot(q, keys, WIDEN_DOT, DOT_PRECISION) * scale_log2  # [ROWS, BLOCK_SIZE] float32
        key_position = logical_block * BLOCK_SIZE + offsets
        allowed = (key_position[None, :] <= position[:, None]) & (key_position[None, :] >= first_position)
        allowed &= key_position[None, :] > position[:, None] - window
        scores = tl.where(allowed, scores, float("-inf"))

        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        rescale = tl.exp2(running_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None] + _dot(probs.to(values.dtype), values, WIDEN_DOT, DOT_PRECISION)
        running_max = new_max

    # A row that saw no key has acc 0 and sum 0: dividing by 1 writes the zeros the contract asks for.
    out = acc / tl.where(running_sum > 0.0, running_sum, 1.0)[:, None]
    out_rows = token * stride_out_token + head * stride_out_head
    tl.store(out_ptr + out_rows[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=io_mask)


def _tile_queries(max_query_len: int, group_padded: int) -> int:
    """Queries per tile: enough (query, head) rows for the longest query run, at least MIN_DOT rows for tl.dot,
    at most MAX_TILE_ROWS so a prefill spreads over many programs."""
    rows = triton.next_power_of_2(max(max_query_len, 1) * group_padded)
    rows = max(MIN_DOT, min(rows, MAX_TILE_ROWS), group_padded)
    return rows // group_padded


def paged_attention_launch(
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
    window: int | None = None,
) -> Tensor:
    """Launches the kernel (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1); the twin's contract."""
    assert q.dim() == 3, f"q must be [T, heads, head_dim], got {tuple(q.shape)}"
    assert key_cache.dim() == 4, f"key_cache must be [blocks, block_size, kv_heads, head_dim], got {key_cache.shape}"
    assert value_cache.shape == key_cache.shape, f"value_cache {value_cache.shape} != key_cache {key_cache.shape}"
    assert key_cache.dtype == value_cache.dtype == q.dtype, "q and the caches must share a dtype (tl.dot's operands)"
    assert key_cache.is_contiguous() and value_cache.is_contiguous(), "the caches are read with their own strides"
    tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    assert cache_head_dim == head_dim, f"cache head_dim {cache_head_dim} != q head_dim {head_dim}"
    assert num_heads % num_kv_heads == 0, f"{num_heads} heads do not share {num_kv_heads} kv heads evenly"
    assert block_size >= MIN_DOT and block_size & (block_size - 1) == 0, (
        f"block_size {block_size} must be a power of two >= {MIN_DOT}: one block is one key tile"
    )
    assert block_tables.dim() == 2 and block_tables.dtype == torch.int32, "block_tables must be [B, max_blocks] int32"
    batch = block_tables.shape[0]
    assert query_starts.shape == (batch + 1,) and query_starts.dtype == torch.int32, "query_starts must be [B+1] int32"
    assert context_lens.shape == (batch,) and context_lens.dtype == torch.int32, "context_lens must be [B] int32"
    assert max_context_len <= block_tables.shape[1] * block_size, "max_context_len exceeds the block tables"
    assert first_position >= 0, f"first_position {first_position} must be >= 0"
    assert window is None or 0 < window < NO_WINDOW, f"window {window} must be positive and below {NO_WINDOW}"

    if q.stride(-1) != 1:
        q = q.contiguous()
    block_tables = block_tables.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if tokens == 0 or batch == 0:
        return out
    group = num_heads // num_kv_heads
    group_padded = triton.next_power_of_2(group)
    queries_per_tile = _tile_queries(max_query_len, group_padded)
    grid = (triton.cdiv(max(max_query_len, 1), queries_per_tile), batch, num_kv_heads)
    _paged_attention_kernel[grid](
        q,
        key_cache,
        value_cache,
        out,
        block_tables,
        query_starts.contiguous(),
        context_lens.contiguous(),
        scale * math.log2(math.e),
        first_position,
        NO_WINDOW if window is None else window,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        GROUP_PADDED=group_padded,
        QUERIES_PER_TILE=queries_per_tile,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=max(MIN_DOT, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
        # float32 caches are for checking against the twin: tf32 would round scores to ~1e-3
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        WIDEN_DOT=q.device.type == "cpu",  # CPU tensors reach the kernel only under the interpreter
        num_warps=NUM_WARPS,
    )
    return out
