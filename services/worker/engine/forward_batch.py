"""One forward pass's inputs, packed: every sequence's new tokens one after another, no padding.

`pack` builds them from per-sequence token rows with array operations on the host (positions, the flat KV slot
of every token, query offsets, context lengths, block tables) and moves them to the device in one copy, through
persistent buffers (InputBuffers). The attention op reads what it needs from here; nothing is per sequence on the
device side.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from services.worker.engine.block_manager import blocks_for
from services.worker.engine.kv_cache import KVCache
from services.worker.model.sequence_spans import SequenceSpan, plan_spans


@dataclass
class ForwardBatch:
    cache: KVCache
    input_ids: Tensor  # [T] int64
    positions: Tensor  # [T] int64: position of each token in its sequence
    slot_mapping: Tensor  # [T] int64: flat KV pool index each token's keys and values go to
    query_starts: Tensor  # [B + 1] int32: sequence b's tokens are rows query_starts[b] .. query_starts[b + 1] - 1
    context_lens: Tensor  # [B] int32: keys of sequence b once this pass has written its tokens
    block_tables: Tensor  # [B, max_blocks] int32
    max_query_len: int
    max_context_len: int
    first_position: int  # keys before this position are not attended to (MTP modules have none at 0)
    host_query_starts: np.ndarray  # [B + 1] int64, the same offsets on the host for slicing outputs
    host: HostBatch  # the pass's integers on the host, which CPU attention plans from
    _spans: list[SequenceSpan] | None = field(default=None, repr=False)

    def attention_spans(self, group: int) -> list[SequenceSpan]:
        """Each sequence's queries and keys for CPU attention with `group` query heads per kv head
        (model/paged_attention.plan_spans), worked out on the first layer's call and kept for the others."""
        if self._spans is None:
            host = self.host
            self._spans = plan_spans(
                host.query_starts.tolist(), host.context_lens.tolist(), host.block_tables.tolist(),
                self.cache.block_size, self.first_position, group, self.input_ids.device, self.cache.keys[0].dtype,
            )
        return self._spans

    @property
    def num_seqs(self) -> int:
        return len(self.host_query_starts) - 1

    @property
    def last_rows(self) -> np.ndarray:
        """[B] the row of each sequence's last token."""
        return self.host_query_starts[1:] - 1


class InputBuffers:
    """The host staging buffer (pinned) and the device buffer that a pass's packed integers travel through. They
    persist across steps, so a step allocates nothing for its inputs and they sit at fixed device addresses. A CPU
    pass needs neither: its host arrays are its tensors (cpu_batch)."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._host = self._device = None
        self._copied: torch.cuda.Event | None = None  # the last host-to-device copy out of the staging buffer

    def upload(self, values: np.ndarray) -> Tensor:
        """values (int64) on the device (not the CPU: to_device takes CPU passes to cpu_batch); valid until the next
        upload."""
        size = values.size
        if self._host is None or self._host.numel() < size:
            capacity = max(size, 2 * (0 if self._host is None else self._host.numel()))
            self._host = torch.empty(capacity, dtype=torch.int64, pin_memory=True)
            self._device = torch.empty(capacity, dtype=torch.int64, device=self.device)
        elif self._copied is not None:
            self._copied.synchronize()  # the staging buffer may still be read by the previous copy
        self._host[:size].numpy()[:] = values
        self._device[:size].copy_(self._host[:size], non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return self._device[:size]


@dataclass
class HostBatch:
    """A pass's packed integers on the host, before they travel to the device (int64 numpy arrays)."""

    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T]
    query_starts: np.ndarray  # [B + 1]
    context_lens: np.ndarray  # [B]
    block_tables: np.ndarray  # [B, blocks]
    max_query_len: int
    max_context_len: int
    first_position: int

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)


def pack_host(
    cache: KVCache, rows: Seq[Seq[int]], starts: Seq[int], slots: Seq[int], first_position: int = 0
) -> HostBatch:
    """Feeds rows[b] at positions starts[b].. of cache slot slots[b]: the packed integers, on the host."""
    num_seqs = len(rows)
    lens = np.fromiter(map(len, rows), dtype=np.int64, count=num_seqs)
    query_starts = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(lens, out=query_starts[1:])
    num_tokens = int(query_starts[-1])
    ids = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=num_tokens)
    starts_np = np.asarray(starts, dtype=np.int64)
    slots_np = np.asarray(slots, dtype=np.int64)
    positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(query_starts[:-1] - starts_np, lens)
    context_lens = starts_np + lens
    max_context_len = int(context_lens.max(initial=0))
    if max_context_len > cache.max_model_len:
        raise ValueError(f"position {max_context_len - 1} is past max_model_len {cache.max_model_len}")
    return HostBatch(
        input_ids=ids,
        positions=positions,
        slot_mapping=cache.slot_mapping(np.repeat(slots_np, lens), positions),
        query_starts=query_starts,
        context_lens=context_lens,
        block_tables=cache.block_tables[slots_np, : max(1, blocks_for(max_context_len, cache.block_size))],
        max_query_len=int(lens.max(initial=0)),
        max_context_len=max_context_len,
        first_position=first_position,
    )


def host_layout(host: HostBatch) -> np.ndarray:
    """The batch's integers in one flat int64 array, in the order `device_batch` splits them."""
    return np.concatenate([
        host.input_ids, host.positions, host.slot_mapping, host.query_starts, host.context_lens,
        host.block_tables.ravel(),
    ])


def device_batch(cache: KVCache, host: HostBatch, staged: Tensor) -> ForwardBatch:
    """The ForwardBatch over `staged`, host_layout(host) on the device: views of it, the index tensors as int32."""
    num_tokens, num_seqs = host.num_tokens, host.num_seqs
    tables = host.block_tables
    parts = torch.split(staged, [num_tokens, num_tokens, num_tokens, num_seqs + 1, num_seqs, tables.size])
    return ForwardBatch(
        cache=cache,
        input_ids=parts[0],
        positions=parts[1],
        slot_mapping=parts[2],
        query_starts=parts[3].to(torch.int32),
        context_lens=parts[4].to(torch.int32),
        block_tables=parts[5].view(tables.shape).to(torch.int32),
        max_query_len=host.max_query_len,
        max_context_len=host.max_context_len,
        first_position=host.first_position,
        host_query_starts=host.query_starts,
        host=host,
    )


def cpu_batch(cache: KVCache, host: HostBatch) -> ForwardBatch:
    """The ForwardBatch over the host arrays themselves, for a CPU pass: no staging and no copy (a CPU decode step
    pays every op, and `device_batch`'s concatenation, split and casts are a dozen of them)."""
    as_tensor = torch.from_numpy
    return ForwardBatch(
        cache=cache,
        input_ids=as_tensor(host.input_ids),
        positions=as_tensor(host.positions),
        slot_mapping=as_tensor(host.slot_mapping),
        query_starts=as_tensor(host.query_starts.astype(np.int32)),
        context_lens=as_tensor(host.context_lens.astype(np.int32)),
        block_tables=as_tensor(host.block_tables.astype(np.int32, copy=False)),
        max_query_len=host.max_query_len,
        max_context_len=host.max_context_len,
        first_position=host.first_position,
        host_query_starts=host.query_starts,
        host=host,
    )


def to_device(cache: KVCache, host: HostBatch, buffers: InputBuffers) -> ForwardBatch:
    """The pass's ForwardBatch on the buffers' device: the host arrays as they are on the CPU, one staged copy
    elsewhere."""
    if buffers.device.type == "cpu":
        return cpu_batch(cache, host)
    return device_batch(cache, host, buffers.upload(host_layout(host)))


def pack(
    cache: KVCache,
    rows: Seq[Seq[int]],
    starts: Seq[int],
    slots: Seq[int],
    buffers: InputBuffers,
    first_position: int = 0,
) -> ForwardBatch:
    """Feeds rows[b] at positions starts[b].. of cache slot slots[b], on the device (in one copy, where that is not the
    CPU)."""
    return to_device(cache, pack_host(cache, rows, starts, slots, first_position), buffers)
