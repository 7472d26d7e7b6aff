"""The weight-read floor of a decode step: the time to read, once, every weight a plain decode step needs, at the
copy bandwidth this device shows in the same run.

A decode step at batch 1 is bound by memory: each weight is read once and used for one row. So no engine can step
faster than (bytes read) / (bandwidth), and the ratio of the two is what share of the memory an engine uses.
The bandwidth is measured, not taken from a data sheet: a device-to-device copy of a buffer far larger than any
cache, timed with CUDA events (wall clock elsewhere), counting the bytes read and the bytes written.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from services.worker.model.llama import CausalLM

COPY_TRIALS = 5  # the fastest trial counts: the floor is what the memory can do, not an average over noise
COPIES_PER_TRIAL = 4
BYTES_PER_COPIED_BYTE = 2  # a copy reads each byte once and writes it once
MS_PER_S = 1e3


def copy_bandwidth(device: torch.device, num_bytes: int) -> float:
    """Bytes per second a device-to-device copy of num_bytes moves (read + written), the best of COPY_TRIALS."""
    source = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)  # first touch: pages mapped, the copy kernel loaded
    best = float("inf")
    for _ in range(COPY_TRIALS):
        best = min(best, _timed_copies(source, target))
    return BYTES_PER_COPIED_BYTE * num_bytes * COPIES_PER_TRIAL / best


def _timed_copies(source: torch.Tensor, target: torch.Tensor) -> float:
    """Seconds COPIES_PER_TRIAL copies of source into target take."""
    if source.device.type != "cuda":
        started = time.perf_counter()
        for _ in range(COPIES_PER_TRIAL):
            target.copy_(source)
        return time.perf_counter() - started
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(source.device)
    start.record()
    for _ in range(COPIES_PER_TRIAL):
        target.copy_(source)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / MS_PER_S


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class WeightFloor:
    weight_bytes: int  # every parameter the checkpoint holds (a tied head counted once)
    read_bytes: int  # what one plain decode step reads: decoder layers, final norm and the LM head
    bandwidth: float  # bytes per second, measured by copy_bandwidth

    @property
    def ms_per_step(self) -> float:
        return MS_PER_S * self.read_bytes / self.bandwidth

    @property
    def tokens_per_s_batch1(self) -> float:
        return MS_PER_S / self.ms_per_step

    def as_dict(self) -> dict:
        return {"weight_bytes": self.weight_bytes, "read_bytes_per_step": self.read_bytes,
                "copy_bandwidth_gb_s": self.bandwidth / 1e9, "ms_per_step": self.ms_per_step,
                "tokens_per_s_batch1": self.tokens_per_s_batch1}


def weight_floor(model: CausalLM, bandwidth: float) -> WeightFloor:
    """The floor of `model`'s decode step. An untied input embedding is left out of the bytes read (a lookup
    reads a row per token, not the table), and so are MTP modules (plain decoding does not run them)."""
    stack = model.model
    # The CPU layout keeps the head as a transposed copy (model/transposed.py): the one its steps read.
    head = model.head_weight_t if model.head_weight_t is not None else model.head_weight
    read = _nbytes(stack.layers.parameters()) + _nbytes(stack.norm.parameters()) + _nbytes([head])
    embedding = stack.embed_tokens.weight
    everything = read + _nbytes(stack.mtp_layers.parameters())
    if not model.config.tie_word_embeddings:
        everything += _nbytes([embedding])
    return WeightFloor(weight_bytes=everything, read_bytes=read, bandwidth=bandwidth)
