"""Paged attention: the torch twin (both of its CPU strategies) against a naive per-query softmax, and the Triton
kernel, run by Triton's interpreter on CPU tensors, against the twin. Ragged packed batches mix sequences with no
query, decode (1), verification (4, 9) and prefill-length query runs, and verify batches give every sequence K + 1
queries at its own context length (float32 and bfloat16, every GQA ratio); contexts cross block boundaries; block
tables are contiguous runs or shuffled; GQA ratios 1, 2 and 4; first_position 0 and 1; float32 and bfloat16. The
twin reads both cache layouts (block-major, the kernel's; head-major, the CPU's) to the same result. A sliding window
(Mistral) shorter than the contexts: the twin against the naive softmax over each query's window, the kernel against
the twin; blocks wholly below every query's window, which a sequence lets go of, never loaded by the kernel and masked
out by the twin.
"""

from __future__ import annotations

from tests.kernelfixture import single_thread  # noqa: F401  (first: it puts triton in interpreter mode)

import pytest
import torch

pytest.importorskip("triton")

from kernels.paged_attention import paged_attention_launch  # noqa: E402
from services.worker.model.paged_attention import (  # noqa: E402
    attend_gathered,
    attend_per_sequence,
    paged_attention,
    paged_attention_torch,
)
from services.worker.model.sequence_spans import Pool, plan_spans  # noqa: E402

BLOCK_SIZE = 16
HEAD_DIM = 16
SCALE = 0.3
FLOAT32_TOLERANCE = 1e-5
# bfloat16 keeps 8 bits of mantissa: the probabilities and outputs are rounded to ~4e-3 relative, outputs are O(1).
BFLOAT16_TOLERANCE = 3e-2
SPARE_BLOCKS = 3  # pool blocks no sequence owns: table entries past a sequence's blocks point anywhere

# (queries, context) per sequence: no query, decode at a block edge, verify across a boundary, prefill, decode
# of a one-key context (no key at all when first_position is 1), a long decode, verify of K + 1 = 9.
RAGGED = ((0, 5), (1, 16), (4, 33), (37, 37), (1, 1), (1, 70), (9, 41))
DECODE = ((1, 17), (1, 64), (1, 3), (1, 48), (1, 31))
# A verify step: every sequence has K + 1 queries (K = 3 or 5, or 1 left after a short draft) at its own context,
# the runs starting mid-block, at a block start, and straddling one or two block boundaries.
VERIFY = ((4, 4), (4, 19), (6, 64), (2, 100), (4, 33), (6, 17))


class Batch:
    """A packed batch over a paged cache, with each sequence's keys and values also kept in position order
    (`logical_keys[b][x]` is position x) for the naive reference."""

    def __init__(
        self,
        shape: tuple[tuple[int, int], ...],
        num_heads: int,
        num_kv_heads: int,
        layout: str,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        head_dim: int = HEAD_DIM,
    ) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.counts = [count for count, _ in shape]
        self.contexts = [context for _, context in shape]
        self.logical_keys, self.logical_values = (
            [torch.randn(c, num_kv_heads, head_dim, generator=generator).to(dtype) for c in self.contexts]
            for _ in range(2)
        )
        self.q = torch.randn(sum(self.counts), num_heads, head_dim, generator=generator).to(dtype)

        owned = [-(-context // BLOCK_SIZE) for context in self.contexts]
        pool = sum(owned) + SPARE_BLOCKS
        self.max_blocks = max(owned)
        if layout == "contiguous":  # one ascending run per sequence, the runs in a shuffled order in the pool
            order = torch.randperm(len(shape), generator=generator).tolist()
            run_starts, next_free = [0] * len(shape), SPARE_BLOCKS
            for b in order:
                run_starts[b], next_free = next_free, next_free + owned[b]
            rows = [list(range(start, start + n)) for start, n in zip(run_starts, owned)]
        else:
            assert layout == "shuffled"
            blocks = torch.randperm(pool, generator=generator).tolist()
            rows, taken = [], 0
            for n in owned:
                rows.append(blocks[taken : taken + n])
                taken += n
        garbage = torch.randint(0, pool, (len(shape), self.max_blocks), generator=generator)
        self.block_tables = garbage.to(torch.int32)
        # Unowned blocks hold noise that a wrong mask or a wrong block would let through.
        self.key_cache = torch.randn(pool, BLOCK_SIZE, num_kv_heads, head_dim, generator=generator).to(dtype)
        self.value_cache = torch.randn(pool, BLOCK_SIZE, num_kv_heads, head_dim, generator=generator).to(dtype)
        for b, row in enumerate(rows):
            self.block_tables[b, : len(row)] = torch.tensor(row, dtype=torch.int32)
            for x in range(self.contexts[b]):
                self.key_cache[row[x // BLOCK_SIZE], x % BLOCK_SIZE] = self.logical_keys[b][x]
                self.value_cache[row[x // BLOCK_SIZE], x % BLOCK_SIZE] = self.logical_values[b][x]

        starts = [0]
        for count in self.counts:
            starts.append(starts[-1] + count)
        self.query_starts = torch.tensor(starts, dtype=torch.int32)
        self.context_lens = torch.tensor(self.contexts, dtype=torch.int32)
        self.max_query_len = max(self.counts)
        self.max_context_len = max(self.contexts)

    def caches(self, head_major: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The caches block-major [blocks, block_size, kv_heads, head_dim] or head-major [kv_heads, positions,
        head_dim] (the same flat slots)."""
        if not head_major:
            return self.key_cache, self.value_cache
        return tuple(c.permute(2, 0, 1, 3).reshape(c.shape[2], -1, c.shape[3]) for c in (self.key_cache, self.value_cache))

    def args(self, first_position: int, head_major: bool = False) -> tuple:
        keys, values = self.caches(head_major)
        return (
            self.q, keys, values, self.block_tables, self.query_starts, self.context_lens, SCALE,
            self.max_query_len, self.max_context_len, first_position, *((BLOCK_SIZE,) if head_major else ()),
        )

    def per_sequence(self, first_position: int, head_major: bool = False) -> torch.Tensor:
        keys, values = self.caches(head_major)
        spans = plan_spans(
            self.query_starts.tolist(), self.context_lens.tolist(), self.block_tables.tolist(), BLOCK_SIZE,
            first_position, self.q.shape[1] // keys.shape[0 if head_major else 2], self.q.device,
        )
        return attend_per_sequence(self.q, Pool(keys, BLOCK_SIZE), Pool(values, BLOCK_SIZE), spans, SCALE)

    def gathered(self, first_position: int, head_major: bool = False) -> torch.Tensor:
        keys, values = self.caches(head_major)
        return attend_gathered(
            self.q, Pool(keys, BLOCK_SIZE), Pool(values, BLOCK_SIZE), self.block_tables, self.query_starts,
            self.context_lens, SCALE, self.max_query_len, self.max_context_len, first_position,
        )

    def naive(self, first_position: int, window: int | None = None) -> torch.Tensor:
        """Query by query and head by head: an explicit float64 softmax over that query's allowed keys (the last
        `window` positions up to its own, with a window)."""
        out = torch.zeros(self.q.shape, dtype=torch.float64)
        num_heads, num_kv_heads = self.q.shape[1], self.logical_keys[0].shape[1]
        group = num_heads // num_kv_heads
        token = 0
        for count, context, keys, values in zip(self.counts, self.contexts, self.logical_keys, self.logical_values):
            for i in range(count):
                position = context - count + i
                for head in range(num_heads):
                    lowest = first_position if window is None else max(first_position, position - window + 1)
                    if position >= first_position:
                        k = keys[lowest : position + 1, head // group].double()
                        v = values[lowest : position + 1, head // group].double()
                        weights = torch.softmax(k @ self.q[token, head].double() * SCALE, dim=0)
                        out[token, head] = weights @ v
                token += 1
        return out


def _close(got: torch.Tensor, want: torch.Tensor, tolerance: float) -> None:
    assert got.shape == want.shape
    error = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    assert error <= tolerance, f"max error {error} > {tolerance}"


GQA = [(4, 4), (4, 2), (8, 2)]  # (heads, kv heads): ratios 1, 2, 4


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), GQA)
@pytest.mark.parametrize("layout", ["contiguous", "shuffled"])
@pytest.mark.parametrize("first_position", [0, 1])
@pytest.mark.parametrize("head_major", [False, True], ids=["block-major", "head-major"])
def test_twin_matches_naive_reference(
    num_heads: int, num_kv_heads: int, layout: str, first_position: int, head_major: bool
) -> None:
    batch = Batch(RAGGED, num_heads, num_kv_heads, layout, seed=num_heads + num_kv_heads)
    want = batch.naive(first_position)
    args = batch.args(first_position, head_major)
    _close(paged_attention_torch(*args), want, FLOAT32_TOLERANCE)
    _close(batch.per_sequence(first_position, head_major), want, FLOAT32_TOLERANCE)
    _close(batch.gathered(first_position, head_major), want, FLOAT32_TOLERANCE)
    if first_position == 1:  # the one-key decode and the prefill's first query see no key
        assert not paged_attention_torch(*args)[[37 + 4 + 1, 4 + 1]].any()


@pytest.mark.parametrize("first_position", [0, 1])
def test_view_path_and_gather_path_agree(first_position: int) -> None:
    """The same logical contexts as contiguous runs (read as views) and shuffled (gathered) give one result, and
    the per-sequence and batched strategies the twin chooses between agree on decode batches."""
    contiguous = Batch(RAGGED, 8, 4, "contiguous", seed=5)
    shuffled = Batch(RAGGED, 8, 4, "shuffled", seed=5)
    assert all(torch.equal(a, b) for a, b in zip(contiguous.logical_keys, shuffled.logical_keys))
    want = paged_attention_torch(*shuffled.args(first_position))
    _close(paged_attention_torch(*contiguous.args(first_position)), want, 1e-6)
    for layout in ("contiguous", "shuffled"):
        decode = Batch(DECODE, 8, 4, layout, seed=6)
        batched = decode.gathered(first_position)
        _close(decode.per_sequence(first_position), batched, 1e-6)
        _close(paged_attention_torch(*decode.args(first_position)), batched, 1e-6)


def test_twin_in_bfloat16_matches_naive_reference() -> None:
    batch = Batch(RAGGED, 8, 2, "shuffled", dtype=torch.bfloat16, seed=7)
    for first_position in (0, 1):
        got = paged_attention_torch(*batch.args(first_position))
        assert got.dtype == torch.bfloat16
        _close(got, batch.naive(first_position), BFLOAT16_TOLERANCE)
        _close(batch.gathered(first_position), batch.naive(first_position), BFLOAT16_TOLERANCE)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), GQA)
@pytest.mark.parametrize("first_position", [0, 1])
def test_kernel_matches_twin(num_heads: int, num_kv_heads: int, first_position: int) -> None:
    batch = Batch(RAGGED, num_heads, num_kv_heads, "shuffled", seed=num_heads * num_kv_heads)
    args = batch.args(first_position)
    _close(paged_attention_launch(*args), paged_attention_torch(*args), FLOAT32_TOLERANCE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), GQA)
def test_kernel_on_verify_batches(dtype: torch.dtype, num_heads: int, num_kv_heads: int) -> None:
    batch = Batch(VERIFY, num_heads, num_kv_heads, "shuffled", dtype=dtype, seed=num_heads + 3 * num_kv_heads)
    args = batch.args(0)
    got = paged_attention_launch(*args)
    assert got.dtype == dtype
    if dtype == torch.float32:
        _close(got, paged_attention_torch(*args), FLOAT32_TOLERANCE)
    else:
        _close(got, batch.naive(0), BFLOAT16_TOLERANCE)
        _close(got, paged_attention_torch(*args), BFLOAT16_TOLERANCE)


def test_kernel_on_contiguous_runs_bfloat16_and_padded_shapes() -> None:
    batch = Batch(DECODE, 8, 2, "contiguous", seed=11)
    _close(paged_attention_launch(*batch.args(1)), paged_attention_torch(*batch.args(1)), FLOAT32_TOLERANCE)
    batch = Batch(RAGGED[1:4], 8, 2, "shuffled", dtype=torch.bfloat16, seed=12)
    got = paged_attention_launch(*batch.args(0))
    assert got.dtype == torch.bfloat16
    _close(got, batch.naive(0), BFLOAT16_TOLERANCE)
    # 6 heads over 2 kv heads (a group of 3, padded to 4 rows) and head_dim 24 (padded to 32).
    batch = Batch(RAGGED[1:4], 6, 2, "shuffled", seed=13, head_dim=24)
    _close(paged_attention_launch(*batch.args(1)), batch.naive(1), FLOAT32_TOLERANCE)


def test_queries_read_in_place_from_a_fused_projection() -> None:
    """q may be the query slice of a fused qkv output: rows strided, heads contiguous."""
    batch = Batch(RAGGED, 4, 2, "shuffled", seed=9)
    fused = torch.randn(batch.q.shape[0], 8, HEAD_DIM)  # 4 query heads, then 2 + 2 kv heads
    fused[:, :4] = batch.q
    args = batch.args(1)
    want = paged_attention_torch(*args)
    for attend in (paged_attention_launch, paged_attention_torch):
        got = attend(fused[:, :4], *args[1:])
        assert got.is_contiguous()
        _close(got, want, FLOAT32_TOLERANCE)


def test_empty_batches() -> None:
    batch = Batch(((0, 4), (0, 20)), 4, 2, "shuffled")
    for attend in (paged_attention_launch, paged_attention_torch):
        out = attend(*batch.args(0))
        assert out.shape == (0, 4, HEAD_DIM)
    batch = Batch(((1, 1), (1, 1)), 4, 2, "contiguous")  # every query is before first_position
    for attend in (paged_attention_launch, paged_attention_torch):
        assert not attend(*batch.args(1)).any()


def test_dispatcher_runs_the_twin_on_cpu_and_launcher_checks_shapes() -> None:
    batch = Batch(RAGGED, 4, 2, "shuffled", seed=3)
    args = batch.args(0)
    assert torch.equal(paged_attention(*args), paged_attention_torch(*args))
    with pytest.raises(AssertionError, match="dtype"):
        paged_attention_launch(batch.q.double(), *args[1:])
    with pytest.raises(AssertionError, match="block_tables"):
        paged_attention_launch(*args[:3], batch.block_tables.long(), *args[4:])
    with pytest.raises(AssertionError, match="block_size"):
        half_blocks = batch.key_cache[:, :8].contiguous()
        paged_attention_launch(batch.q, half_blocks, half_blocks, *args[3:])
    with pytest.raises(AssertionError, match="heads"):
        paged_attention_launch(batch.q[:, :3], *args[1:])


WINDOWS = (1, 7, 20)  # one key, less than a block, more than one block


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("head_major", [False, True], ids=["block-major", "head-major"])
def test_twin_honours_a_sliding_window(window: int, head_major: bool) -> None:
    batch = Batch(RAGGED, 8, 2, "shuffled", seed=window)
    for first_position in (0, 1):
        got = paged_attention(*batch.args(first_position, head_major), window=window)
        _close(got, batch.naive(first_position, window), FLOAT32_TOLERANCE)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("cases", [RAGGED, VERIFY], ids=["ragged", "verify"])
def test_kernel_honours_a_sliding_window(window: int, cases) -> None:
    batch = Batch(cases, 8, 2, "shuffled", seed=window + 1)
    args = batch.args(0)
    _close(paged_attention_launch(*args, window=window), batch.naive(0, window), FLOAT32_TOLERANCE)


def _drop_out_of_window(batch: Batch, window: int, content: float) -> None:
    """Points each sequence's table entries wholly below its earliest query's window at one more block of the pool,
    filled with `content`, as the engine does with the blocks a sliding window's sequence let go of
    (engine/block_manager.py: they read the padding block)."""
    dropped = batch.key_cache.shape[0]
    extra = torch.full((1, *batch.key_cache.shape[1:]), content, dtype=batch.key_cache.dtype)
    batch.key_cache, batch.value_cache = torch.cat([batch.key_cache, extra]), torch.cat([batch.value_cache, extra])
    for b, (count, context) in enumerate(zip(batch.counts, batch.contexts)):
        reach = context - count - window + 1  # the lowest key any of its queries sees
        batch.block_tables[b, : max(reach, 0) // BLOCK_SIZE] = dropped


@pytest.mark.parametrize("window", WINDOWS)
def test_blocks_below_every_window_are_never_read_by_the_kernel(window: int) -> None:
    """Its walk starts at the first block the tile's earliest query reaches: a dropped block of NaNs never reaches
    the output."""
    batch = Batch(VERIFY, 8, 2, "shuffled", seed=window + 2)
    _drop_out_of_window(batch, window, float("nan"))
    _close(paged_attention_launch(*batch.args(0), window=window), batch.naive(0, window), FLOAT32_TOLERANCE)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("head_major", [False, True], ids=["block-major", "head-major"])
def test_blocks_below_every_window_are_masked_out_by_the_twin(window: int, head_major: bool) -> None:
    """The twin gathers them and masks them out: the padding block they read holds finite keys and values."""
    batch = Batch(VERIFY, 8, 2, "shuffled", seed=window + 3)
    _drop_out_of_window(batch, window, 1e4)
    _close(paged_attention(*batch.args(0, head_major), window=window), batch.naive(0, window), FLOAT32_TOLERANCE)
