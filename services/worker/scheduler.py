"""Continuous batching: which sequences run this step. Plain-Python bookkeeping, unit-tested without a model.

Sequences join between steps while a cache slot is free and leave as soon as they finish or are aborted.
The static KV cache reserves `max_model_len` positions per slot, so a running sequence never runs out of
memory and needs no preemption; a block-paged cache will bring both.
"""

from __future__ import annotations

from collections import deque

from shared.frames import FinishReason
from services.worker.sequence import Sequence, SeqState


class Scheduler:
    def __init__(self, max_num_seqs: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def admit(self) -> list[Sequence]:
        """Moves waiting sequences into free slots, first come first served; returns the admitted ones."""
        admitted = []
        while self.waiting and self._free_slots:
            seq = self.waiting.popleft()
            seq.slot = self._free_slots.pop()
            seq.state = SeqState.RUNNING
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def release_finished(self) -> list[Sequence]:
        """Frees the slots of finished sequences and returns them."""
        done = [s for s in self.running if s.is_finished]
        for seq in done:
            self._free_slots.append(seq.slot)
            seq.slot = None
        self.running = [s for s in self.running if not s.is_finished]
        return done

    def abort(self, request_id: str) -> Sequence | None:
        """Marks the sequence finished (ABORT) wherever it is; a running one frees its slot at the next release."""
        for seq in list(self.waiting):
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                break
        else:
            seq = next((s for s in self.running if s.request_id == request_id), None)
            if seq is None:
                return None
        seq.state = SeqState.FINISHED
        seq.finish_reason = FinishReason.ABORT
        return seq
