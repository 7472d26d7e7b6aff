"""Continuous batching: which sequences run this step. Plain-Python bookkeeping, unit-tested without a model.

Sequences join between steps while a cache slot and the KV blocks for their whole prefill are free, first come
first served, and leave as soon as they finish or are aborted. Before each step every running sequence is
given the blocks the step may write; when blocks run out, the most recently admitted sequences are preempted:
their slot and blocks are freed and they wait at the front of the queue to be recomputed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from shared.frames import FinishReason
from services.worker.block_manager import BlockManager
from services.worker.sequence import Sequence, SeqState


@dataclass
class StepPlan:
    """What runs in one step."""

    prefills: list[Sequence]  # admitted now: their cache is computed from position 0 (new ones sample a token)
    decodes: list[Sequence]  # score their last token and drafts against the cache (resumed admissions included)
    preempted: list[Sequence]  # evicted to make room, newest first

    @property
    def empty(self) -> bool:
        return not (self.prefills or self.decodes)


class Scheduler:
    def __init__(self, max_num_seqs: int, blocks: BlockManager | None = None, lookahead: int = 0) -> None:
        """blocks: the KV block pool; None leaves memory unlimited (a slot is all a sequence needs).
        lookahead: positions a step may write past a sequence's tokens (drafts, and MTP's self-fed entries)."""
        self.max_num_seqs = max_num_seqs
        self.blocks = blocks
        self.lookahead = lookahead
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def _tokens_needed(self, seq: Sequence) -> int:
        return seq.num_tokens + self.lookahead

    def admit(self) -> list[Sequence]:
        """Moves waiting sequences into free slots while their blocks fit, first come first served (the head of
        the queue is never overtaken); returns the admitted ones."""
        admitted = []
        while self.waiting and self._free_slots:
            seq = self.waiting[0]
            slot = self._free_slots[-1]
            if self.blocks is not None:
                if not self.blocks.can_allocate(slot, self._tokens_needed(seq)):
                    break
                self.blocks.allocate(slot, self._tokens_needed(seq))
            self.waiting.popleft()
            seq.slot = self._free_slots.pop()
            seq.state = SeqState.RUNNING
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def reserve(self) -> list[Sequence]:
        """Gives every running sequence the blocks this step may write, oldest first, preempting the most
        recently admitted ones while blocks are short; returns the preempted sequences, newest first."""
        preempted: list[Sequence] = []
        if self.blocks is None:
            return preempted
        index = 0
        while index < len(self.running):
            seq = self.running[index]
            needed = self._tokens_needed(seq)
            while not self.blocks.can_allocate(seq.slot, needed) and self.running[-1] is not seq:
                preempted.append(self._preempt(self.running[-1]))
            if self.blocks.can_allocate(seq.slot, needed):
                self.blocks.allocate(seq.slot, needed)
                index += 1
            else:
                preempted.append(self._preempt(seq))  # the newest left: nothing after it is running
        return preempted

    def schedule(self) -> StepPlan:
        """Reserves this step's blocks (preempting when short) and admits waiting sequences. Blocks just freed by
        preemption would only readmit what was preempted, so admission waits a step after a preemption. A new
        sequence samples its first token in its prefill; one with output (preempted, or handed back by another
        worker) is recomputed up to its last token and then decodes in the same step as if it had never left."""
        preempted = self.reserve()
        admitted = [] if preempted else self.admit()
        fresh = {id(s) for s in admitted if not s.output_ids}
        decodes = [s for s in self.running if id(s) not in fresh and not s.is_finished]
        return StepPlan(prefills=admitted, decodes=decodes, preempted=preempted)

    def _preempt(self, seq: Sequence) -> Sequence:
        """Evicts a running sequence: its cache is dropped and it waits first in line to be recomputed."""
        self.running.remove(seq)
        self._free(seq)
        seq.state = SeqState.WAITING
        seq.num_computed = 0
        self.waiting.appendleft(seq)
        return seq

    def _free(self, seq: Sequence) -> None:
        if self.blocks is not None:
            self.blocks.free(seq.slot)
        self._free_slots.append(seq.slot)
        seq.slot = None

    def release_finished(self) -> list[Sequence]:
        """Frees the slots and blocks of finished sequences and returns them."""
        done = [s for s in self.running if s.is_finished]
        for seq in done:
            self._free(seq)
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
