"""Continuous batching: which sequences run this step. Plain-Python bookkeeping, unit-tested without a model.

Sequences join between steps while a cache slot and the KV blocks for their whole prefill are free, first come
first served, and leave as soon as they finish or are aborted. Before each step every running sequence is
given the blocks the step may write; when blocks run out, the most recently admitted sequences are preempted:
their slot and blocks are freed and they wait at the front of the queue to be recomputed.

With prefix caching, a sequence starts from the cached blocks of its tokens' longest cached prefix (see
block_manager.py) and computes only the rest, at least one token. The choices of a request wait in the queue one
after another. Those admitted in the same step as the request's first fresh choice (its leader) share the
leader's full prompt blocks instead of computing them: each computes only the rest of its prompt, at least its
last token, in the same prefill pass, whose layers write every key before any query reads them. A choice
admitted later, or resumed, starts from what the prefix cache holds of it.

Under a sliding window (Mistral), before each step every running sequence lets go of its leading blocks that no
later pass reaches (`reach`, worked out by the engine over every cache layer, window.py), so a long sequence holds
about a window's worth of blocks rather than its whole context.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.frames import FinishReason
from shared.prefix_hash import BlockHash, cacheable_blocks
from services.worker.engine.block_manager import BlockManager
from services.worker.engine.sequence import Sequence, SeqState


MIN_PROMPT_TOKENS = 16  # prompt tokens a step computes however many rows its decoding sequences take


@dataclass
class StepPlan:
    """What runs in one step."""

    prefills: list[Sequence]  # compute the next piece of their cache (new ones sample a token after the last piece)
    chunks: list[int]  # the tokens each of them computes this step
    decodes: list[Sequence]  # score their last token and drafts against the cache (resumed ones done prefilling too)
    preempted: list[Sequence]  # evicted to make room, newest first
    imports: list[Sequence] = field(default_factory=list)  # admitted with a handoff's state, written before the step

    @property
    def empty(self) -> bool:
        return not (self.prefills or self.decodes)


class Scheduler:
    def __init__(
        self, max_num_seqs: int, blocks: BlockManager | None = None, lookahead: int = 0, share_prompts: bool = True,
        max_num_batched_tokens: int | None = None, rows_per_decode: int = 1, decode: bool = True,
        reach: Callable[[Sequence], int] | None = None,
    ) -> None:
        """blocks: the KV block pool; None leaves memory unlimited (a slot is all a sequence needs).
        lookahead: positions a step may write past a sequence's tokens (drafts, and MTP's self-fed entries).
        share_prompts: whether choices admitted together share their prompt's full blocks (see above).
        max_num_batched_tokens: the rows a step may compute (chunked prefill, see schedule); None: every prefill
        whole. rows_per_decode: the most a decoding sequence scores in a step (its last token and its drafts).
        decode: False on a prefill worker, whose sequences stop after their prefill, to be handed off.
        reach: the lowest position a running sequence's later passes may still read or write (a sliding window's);
        its blocks wholly before it are let go before each step. None: a sequence keeps all its blocks."""
        self.max_num_seqs = max_num_seqs
        self.blocks = blocks
        self.lookahead = lookahead
        self.max_num_batched_tokens = max_num_batched_tokens
        self.rows_per_decode = rows_per_decode
        self.decode = decode
        self.reach = reach
        self.share_prompts = share_prompts and blocks is not None
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        # Prefix cache lookups, in tokens as vLLM counts them: the tokens each admission had to compute, and those of
        # them it found cached.
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.handoffs_recomputed = 0  # handed-off sequences whose cached blocks were gone on admission
        self.handoffs_imported = 0  # handed-off sequences admitted with their handoff's KV

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def _tokens_needed(self, seq: Sequence) -> int:
        return seq.num_tokens + self.lookahead

    def admit(self, budget: float = math.inf) -> list[Sequence]:
        """Moves waiting sequences into free slots while their blocks fit and the step has prompt tokens left of
        `budget`, first come first served (the head of the queue is never overtaken); returns the admitted ones."""
        admitted = []
        leaders: dict[str, Sequence] = {}  # by request id: the first fresh choice admitted now
        while self.waiting and self._free_slots and budget > 0:
            seq = self.waiting[0]
            leader = leaders.get(seq.request_id) if not seq.output_ids else None
            shared = self._shareable_blocks(seq) if leader is not None else 0
            hits = self._cached_prefix(seq) if not shared else None  # None: not looked up
            found = hits or []
            if seq.imported is not None:
                found, hits = self._imported_prefix(seq, found), None
            if self.blocks is not None:
                slot = self.blocks.choose_slot(self._free_slots, self._full_block_names(seq))
                needed = self._tokens_needed(seq)
                if found and not self.blocks.can_reuse(slot, needed, found):
                    if seq.imported is not None:
                        break  # its handoff needs these cached blocks: it waits for room to keep them
                    found = []  # room for its own blocks may still be there
                if not found and not self.blocks.can_allocate(slot, needed, shared):
                    break
                if shared:
                    self.blocks.share(slot, leader.slot, shared)
                elif found:
                    self.blocks.reuse(slot, found)
                self.blocks.allocate(slot, needed)
                # The leader computes shared blocks (in this step's pass or a later one); cached ones are computed.
                seq.num_computed = (shared or len(found)) * self.blocks.block_size
                if seq.imported is not None:
                    seq.num_computed = seq.imported.meta.num_computed  # the handoff brings the rest
                seq.leader = leader if shared else None
                seq.num_published = 0  # its table's blocks are (re)named after its pass
                if hits is not None:
                    self._count_lookup(seq, len(found) * self.blocks.block_size)
            else:
                slot = self._free_slots[-1]
            if self.share_prompts and not seq.output_ids:
                leaders.setdefault(seq.request_id, seq)
            self.waiting.popleft()
            self._free_slots.remove(slot)
            seq.slot = slot
            seq.state = SeqState.RUNNING
            seq.prefill_start = seq.num_computed
            seq.admission += 1
            seq.timeline.on_scheduled()
            self.running.append(seq)
            admitted.append(seq)
            budget -= seq.prefill_target - seq.num_computed
        return admitted

    def _cached_prefix(self, seq: Sequence) -> list[int] | None:
        """The cached blocks of the sequence's leading full blocks, leaving at least one token of its prefill to
        compute (prefix_hash.cacheable_blocks); None when it does not look: no cache, or a sequence that scores its
        prompt, whose scores come from its own prefill of every position."""
        if self.blocks is None or not self.blocks.caching or seq.cache_root is None or seq.scores_prompt:
            return None
        size = self.blocks.block_size
        return self.blocks.lookup(seq.names(cacheable_blocks(seq.prefill_target, size), size))

    def _full_block_names(self, seq: Sequence) -> list[BlockHash]:
        """The names of the sequence's full blocks, for the choice of its slot; none without a cache to name them."""
        if not self.blocks.caching or seq.cache_root is None:
            return []
        size = self.blocks.block_size
        return seq.names(seq.prefill_target // size, size)

    def _imported_prefix(self, seq: Sequence, hits: list[int]) -> list[int]:
        """The cached blocks a handed-off sequence starts from: those its handoff left out because this worker
        holds them. Without all of them the handoff is dropped and the sequence recomputed (counted)."""
        first = seq.imported.meta.first_block
        if first == 0:
            return []
        if self.blocks is None or len(hits) < first:
            seq.imported = None
            self.handoffs_recomputed += 1
            return hits
        return hits[:first]

    def _count_lookup(self, seq: Sequence, cached: int) -> None:
        """Counts a lookup as vLLM does, in tokens: those the sequence had to compute, and those found cached."""
        self.prefix_queries += seq.prefill_target
        self.prefix_hits += cached
        if not seq.output_ids:
            seq.num_cached_tokens = cached

    def _shareable_blocks(self, seq: Sequence) -> int:
        """Full prompt blocks a fresh choice can share with its leader: all but the one holding the prompt's last
        token, which the choice computes itself to get its own first logits."""
        if not self.share_prompts:
            return 0
        return cacheable_blocks(len(seq.prompt_ids), self.blocks.block_size)

    def reserve(self) -> list[Sequence]:
        """Gives every running sequence the blocks this step may write, oldest first, preempting the most
        recently admitted ones while blocks are short; returns the preempted sequences, newest first."""
        preempted: list[Sequence] = []
        if self.blocks is None:
            return preempted
        if self.reach is not None:
            self._drop_out_of_reach()
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

    def _drop_out_of_reach(self) -> None:
        """Lets go of the running sequences' blocks that no later pass reaches. A block that is still to be named in
        the prefix cache stays until it is (after its pass, Engine._publish), so that it idles there named."""
        size = self.blocks.block_size
        caching = self.blocks.caching
        for seq in self.running:
            position = self.reach(seq)
            if caching and seq.cache_root is not None:
                position = min(position, seq.num_published * size)
            self.blocks.drop_before(seq.slot, position)

    def schedule(self) -> StepPlan:
        """Reserves this step's blocks (preempting when short), admits waiting sequences and shares out the step's
        rows. Blocks just freed by preemption would only readmit what was preempted, so admission waits a step after
        a preemption.

        Chunked prefill: every decoding sequence gets its rows (its last token and the most drafts it may verify),
        and the rest of max_num_batched_tokens (at least MIN_PROMPT_TOKENS, so prompts always progress) goes to
        prompts, oldest first: a long prompt is computed over several steps while the others keep decoding. A choice
        that shares its leader's blocks computes only once the leader's pieces reach its own start, in the same
        pass at the earliest. A new sequence samples its first token after its last piece; one with output
        (preempted, or handed back by another worker) is recomputed up to its last token and then decodes in the
        same step as if it had never left."""
        preempted = self.reserve()
        preempted += [self._preempt(s) for s in self._orphans()]
        decoding = [s for s in self.running if not s.is_finished and not s.is_prefilling]
        budget = math.inf
        if self.max_num_batched_tokens is not None:
            budget = max(self.max_num_batched_tokens - len(decoding) * self.rows_per_decode, MIN_PROMPT_TOKENS)
        admitted = []
        if not preempted:
            admitted = self.admit(
                budget - sum(s.prefill_target - s.num_computed for s in self.running if s.is_prefilling)
            )
        prefills, chunks = self._share_out(budget)
        completing = {id(s) for s, chunk in zip(prefills, chunks) if s.num_computed + chunk == s.prefill_target}
        decodes = [
            s for s in self.running
            if not s.is_finished and (not s.is_prefilling or (s.output_ids and id(s) in completing))
        ] if self.decode else self._stranded(prefills, admitted)
        imports = [s for s in admitted if s.imported is not None]
        self.handoffs_imported += len(imports)
        return StepPlan(prefills=prefills, chunks=chunks, decodes=decodes, preempted=preempted, imports=imports)

    def _stranded(self, prefills: list[Sequence], admitted: list[Sequence]) -> list[Sequence]:
        """On a prefill worker, the choices that decode here after all. A request is handed off once every choice
        has its first token; when nothing is admitted or prefilled while choices still wait (a request's n above
        the free slots, or too few blocks for all of them), the choices holding slots would wait on their siblings
        for ever. They decode here instead, until they finish and make room; the rest are handed off after."""
        if prefills or admitted or not self.waiting:
            return []
        waiting = {s.request_id for s in self.waiting}
        return [s for s in self.running if not s.is_finished and not s.is_prefilling and s.request_id in waiting]

    def _orphans(self) -> list[Sequence]:
        """Choices whose leader left before computing the blocks they share: they start over. (The newest are
        preempted first and a request's choices are cancelled together before they have output, so this is a
        safeguard.) A leader that left after computing them just lets its followers go on."""
        orphans = []
        for seq in self.running:
            leader = seq.leader
            if leader is not None and leader.state is not SeqState.RUNNING:
                if leader.num_computed < seq.num_computed:
                    orphans.append(seq)
                seq.leader = None
        return orphans

    def _share_out(self, budget: float) -> tuple[list[Sequence], list[int]]:
        """The prompt pieces of this step within `budget` tokens, oldest sequence first: (sequences, tokens each)."""
        prefills, chunks = [], []
        reached: dict[int, int] = {}  # id(sequence) -> num_computed after this step
        for seq in [s for s in self.running if not s.is_finished and s.is_prefilling]:
            if budget <= 0:
                break
            if seq.leader is not None:
                if reached.get(id(seq.leader), seq.leader.num_computed) < seq.num_computed:
                    continue  # the blocks it shares are not computed yet
                seq.leader = None
            chunk = int(min(seq.prefill_target - seq.num_computed, budget))
            budget -= chunk
            prefills.append(seq)
            chunks.append(chunk)
            reached[id(seq)] = seq.num_computed + chunk
        return prefills, chunks

    def _preempt(self, seq: Sequence) -> Sequence:
        """Evicts a running sequence: its cache is dropped and it waits first in line to be recomputed."""
        self.running.remove(seq)
        self._free(seq)
        seq.state = SeqState.WAITING
        seq.num_computed = 0
        seq.leader = None
        self.waiting.appendleft(seq)
        return seq

    def hand_off(self, seq: Sequence) -> None:
        """Takes a running sequence out, its state exported to another worker: its slot and blocks are freed (the
        blocks it published stay in the prefix cache)."""
        self.running.remove(seq)
        self._free(seq)
        seq.state = SeqState.HANDED_OFF

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

    def abort(self, request_id: str, choice: int | None = None) -> list[Sequence]:
        """Marks the request's unfinished sequences (every choice, or the one named) finished (ABORT) wherever they
        are, and returns them; running ones free their slots at the next release."""

        def named(seq: Sequence) -> bool:
            return seq.request_id == request_id and (choice is None or seq.choice == choice)

        aborted = [s for s in self.waiting if named(s)]
        for seq in aborted:
            self.waiting.remove(seq)
        aborted += [s for s in self.running if named(s) and not s.is_finished]
        for seq in aborted:
            seq.state = SeqState.FINISHED
            seq.finish_reason = FinishReason.ABORT
        return aborted
