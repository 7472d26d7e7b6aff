"""Decode and verify passes replayed as CUDA graphs: one graph per (batch bucket, query length), captured once.

A decode or verify step on a GPU is dozens of small kernels per layer; launched one by one from Python they cost
more than they compute. Captured, a pass is one launch. A graph replays fixed shapes at fixed addresses, so:

- a batch is padded up to its shape: B real sequences up to the bucket's, each sequence's rows up to its query
  length Q. Real sequences keep their own rows (their positions are unchanged); the leftover rows form padding
  sequences of at most Q rows each, over the cache's padding slot, whose keys and values land in the padding
  block and whose outputs are dropped. A shape therefore has 2 * bucket sequence entries (real + padding), and
  unused entries have no rows and no context, so their attention programs return at once.
- the pass's integers travel through one static device buffer (the graph reads it in place), filled by one
  host-to-device copy before the replay; the int32 views attention needs are made inside the graph.
- everything that sizes work on the host is fixed by the shape: max_query_len is Q, max_context_len is the
  cache's max_model_len (the attention kernel's loop bounds come from the device's context_lens).

Prefill, MTP passes and any batch larger than the largest shape run eagerly. On the CPU there is nothing to
capture; `capture=False` runs the same padded pass eagerly, which is how the padding is tested without a GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor

from services.worker.engine.forward_batch import ForwardBatch, HostBatch, device_batch, host_layout
from services.worker.engine.kv_cache import KVCache

log = logging.getLogger(__name__)

SMALL_BUCKETS = (1, 2, 4)  # a lone request and small batches get tight shapes
BUCKET_STEP = 8  # then every multiple of 8, as vLLM and SGLang bucket their graphs
PAD_TOKEN_ID = 0  # any id in the vocabulary: padding rows' outputs are dropped
WARMUP_PASSES = 2  # eager passes before capture: Triton compiles and autotunes outside the graph

Forward = Callable[[Tensor, Tensor, ForwardBatch], Tensor]  # (input_ids, positions, batch) -> hidden [T, hidden]


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Ascending bucket sizes; the last is max_num_seqs, so every batch the engine runs has one."""
    candidates = [*SMALL_BUCKETS, *range(BUCKET_STEP, max_num_seqs, BUCKET_STEP)]
    return sorted({b for b in candidates if b < max_num_seqs} | {max_num_seqs})


@dataclass(frozen=True, order=True)
class GraphShape:
    num_seqs: int  # real sequences, at most
    query_len: int  # rows per sequence, at most

    @property
    def num_tokens(self) -> int:
        return self.num_seqs * self.query_len

    @property
    def num_entries(self) -> int:
        """Sequence entries: the real ones, and padding ones that each take up to query_len leftover rows."""
        return 2 * self.num_seqs

    def fits(self, host: HostBatch) -> bool:
        return (
            host.num_seqs <= self.num_seqs and host.max_query_len <= self.query_len and host.first_position == 0
        )


def pad_host(host: HostBatch, shape: GraphShape, cache: KVCache) -> HostBatch:
    """`host` padded to `shape` (see the module docstring); block tables at their full width."""
    assert shape.fits(host), f"{shape} does not fit {host.num_seqs} sequences of up to {host.max_query_len} rows"
    num_pad_rows = shape.num_tokens - host.num_tokens
    full, rest = divmod(num_pad_rows, shape.query_len)
    pad_counts = np.array([shape.query_len] * full + ([rest] if rest else []), dtype=np.int64)
    num_unused = shape.num_entries - host.num_seqs - len(pad_counts)
    pad_positions = np.arange(num_pad_rows, dtype=np.int64) % shape.query_len  # each padding entry from 0
    pad_slots = np.full(num_pad_rows, cache.padding_slot, dtype=np.int64)

    width = cache.max_blocks_per_seq
    tables = np.full((shape.num_entries, width), cache.padding_block, dtype=np.int64)
    tables[: host.num_seqs, : host.block_tables.shape[1]] = host.block_tables
    return HostBatch(
        input_ids=np.concatenate([host.input_ids, np.full(num_pad_rows, PAD_TOKEN_ID, dtype=np.int64)]),
        positions=np.concatenate([host.positions, pad_positions]),
        slot_mapping=np.concatenate([host.slot_mapping, cache.slot_mapping(pad_slots, pad_positions)]),
        query_starts=np.concatenate([
            host.query_starts, host.num_tokens + np.cumsum(pad_counts), np.full(num_unused, shape.num_tokens),
        ]),
        context_lens=np.concatenate([host.context_lens, pad_counts, np.zeros(num_unused, dtype=np.int64)]),
        block_tables=tables,
        max_query_len=shape.query_len,
        max_context_len=cache.max_model_len,
        first_position=0,
    )


def empty_host_batch(cache: KVCache) -> HostBatch:
    """No sequence at all: padded, every row is padding (what graphs are captured over)."""
    none = np.zeros(0, dtype=np.int64)
    return HostBatch(none, none, none, np.zeros(1, dtype=np.int64), none, np.zeros((0, 1), dtype=np.int64), 0, 0, 0)


class GraphRunner:
    """Runs the passes that fit a captured shape: pads, copies the integers in, replays, slices the real rows."""

    def __init__(
        self, forward: Forward, cache: KVCache, max_num_seqs: int, query_lens: Iterable[int], capture: bool
    ) -> None:
        self.forward = forward
        self.cache = cache
        self.capture = capture
        self.shapes = sorted(GraphShape(b, q) for b in batch_buckets(max_num_seqs) for q in sorted(set(query_lens)))
        largest = max((host_layout(pad_host(empty_host_batch(cache), s, cache)).size for s in self.shapes), default=0)
        device = cache.keys[0].device
        # The static input buffer every graph reads, and its pinned host staging twin.
        self._staged = torch.zeros(largest, dtype=torch.int64, device=device)
        self._host = torch.zeros(largest, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._graphs: dict[GraphShape, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[GraphShape, Tensor] = {}  # each graph's static hidden states [num_tokens, hidden]
        self._batches: dict[GraphShape, ForwardBatch] = {}  # each graph's batch, its int32 views graph-owned
        self._copied: torch.cuda.Event | None = None  # the last copy out of the staging buffer
        if capture:
            self._capture_all()

    def shape_for(self, host: HostBatch) -> GraphShape | None:
        """The smallest shape the batch fits, or None (it runs eagerly)."""
        return next((s for s in self.shapes if s.fits(host)), None)

    def run(self, host: HostBatch, shape: GraphShape) -> tuple[Tensor, ForwardBatch]:
        """Hidden states [T, hidden] of the batch's real rows (valid until the next run), and its ForwardBatch
        (device tensors padded; host_query_starts the real ones)."""
        padded = pad_host(host, shape, self.cache)
        staged = self._copy_in(padded)
        if shape in self._graphs:
            self._graphs[shape].replay()
            batch, hidden = self._batches[shape], self._outputs[shape]
        else:
            batch = device_batch(self.cache, padded, staged)
            hidden = self.forward(batch.input_ids, batch.positions, batch)
        return hidden[: host.num_tokens], replace(batch, host_query_starts=host.query_starts)

    def _copy_in(self, padded: HostBatch) -> Tensor:
        """The padded integers into the static buffer (one copy); the filled part of it."""
        values = host_layout(padded)
        if self._copied is not None:
            self._copied.synchronize()  # the previous copy may still read the staging buffer
        self._host[: values.size].numpy()[:] = values
        self._staged[: values.size].copy_(self._host[: values.size], non_blocking=True)
        if self._staged.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
        return self._staged[: values.size]

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """Largest shape first, all in one memory pool: smaller graphs reuse the largest one's memory. The int32
        views attention reads are made inside each graph, so a replay remakes them from the static buffer."""
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        empty = empty_host_batch(self.cache)
        for shape in sorted(self.shapes, reverse=True):
            padded = pad_host(empty, shape, self.cache)
            staged = self._copy_in(padded)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(WARMUP_PASSES):
                    batch = device_batch(self.cache, padded, staged)
                    self.forward(batch.input_ids, batch.positions, batch)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                batch = device_batch(self.cache, padded, staged)
                self._outputs[shape] = self.forward(batch.input_ids, batch.positions, batch)
            self._graphs[shape], self._batches[shape] = graph, batch
        torch.cuda.synchronize()
        log.info("captured %d CUDA graphs: batch buckets %s, query lengths %s", len(self._graphs),
                 sorted({s.num_seqs for s in self.shapes}), sorted({s.query_len for s in self.shapes}))
