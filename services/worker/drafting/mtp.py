"""MTP drafting: the checkpoint's own multi-token-prediction module proposes the next tokens.

The one stateful drafter: it owns the MTP module's KV cache bookkeeping and the drafts waiting for the
next step, kept per cache slot. For a sequence of N tokens x_0..x_{N-1}, between steps:

- the MTP cache holds positions 1..N-1; its entry at position p is the module run on (h_{p-1}, x_p), where
  h is the trunk's last hidden state before the final norm (position 0 has no entry: nothing precedes x_0);
- the pending drafts d_1..d_k and their q rows were computed from the last of those entries;
- beside each full block, the trunk's hidden state at its last position is kept, so that a sequence starting
  from the block in the prefix cache has the h_{p-1} its first computed position pairs with.

`catch_up` restores this after every trunk pass (prefill, or verify with its accepted tokens) in one batched
call, then `draft` feeds the module its own output hidden state and draft to propose the rest. Those
self-fed entries sit past the sequence's end and are overwritten by the next catch-up.

A sequence that will not draft next step (adaptive speculation decided so) is not run through the module: its
trunk states wait in a lag buffer and are caught up, in the same single pass, when it drafts again (or once
the lag reaches LAG_LIMIT tokens). The module's cache entries depend only on (h_{p-1}, x_p) and earlier
entries, so a late catch-up writes the same entries; only steps that draft pay for the module.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from services.worker.drafting.draft import Draft, point_mass_rows
from services.worker.drafting.draft_sampling import DraftSampler, precision_groups
from services.worker.engine.runner import MTP_FIRST_POSITION, ModelRunner, inference
from services.worker.model.flat_drafter import DRAFT_MODULE
from services.worker.engine.sequence import Sequence
from services.worker.grammar.grammars import Grammars

# Every draft step runs module 0 (DRAFT_MODULE). A further module would attend to cache entries that only it could
# write, and catch-up would have to chain every module over the accepted tokens each step; checkpoints in use carry
# one module, and verification keeps the output exact whichever module drafts.
LAG_LIMIT = 256  # tokens a sequence's MTP cache may fall behind before it is caught up anyway


@dataclass
class Lag:
    """Trunk states not yet run through the module: token j at position start + j, paired with hidden[j]."""

    start: int
    hidden: Tensor  # [n, hidden]
    tokens: list[int]

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass
class MtpSlotState:
    """What the drafter keeps for one sequence between steps, as a prefill worker hands it to a decode worker
    (services/worker/handoff/): where its module entries end, its pending drafts with their q, and its lag."""

    end: int
    draft_tokens: list[int]
    draft_probs: Tensor  # [count, vocab] q of each pending draft
    draft_report: Tensor  # [count, vocab] what its draft_logprobs report
    lag: Lag | None = None


class MtpDrafter:
    def __init__(self, runner: ModelRunner, num_steps: int, max_num_seqs: int) -> None:
        vocab_size, device = runner.model.config.vocab_size, runner.device
        self.runner = runner
        self.num_steps = num_steps
        self.vocab_size = vocab_size
        self._tokens = [[0] * num_steps for _ in range(max_num_seqs)]  # by slot: the pending drafts
        self._probs = torch.zeros(max_num_seqs, num_steps, vocab_size, device=device)
        # by slot: whether the pending drafts are point masses (greedy), whose _probs rows are left unwritten
        self._point_mass = [False] * max_num_seqs
        self._report = torch.zeros(max_num_seqs, num_steps, vocab_size, device=device)
        self._count = [0] * max_num_seqs
        self._lag: dict[int, Lag] = {}  # by cache slot
        self._end = [0] * max_num_seqs  # by cache slot: the module's entries are written below this position
        self.grammars: Grammars | None = None  # set by the engine at its first constrained request
        self.min_confidence = 0.0  # a chain stops after a draft less likely than this (SpeculativeConfig)
        # Whether greedy requests' logits and chain passes go through the int8 twins (ModelRunner.quantize_drafting)
        self.int8 = False

    def catch_up(
        self,
        seqs: list[Sequence],
        hidden: Tensor,  # [T, hidden] a trunk pass's hidden states, packed
        first_rows: list[int],
        tokens: list[list[int]],
        starts: list[int],
        budgets: list[int | None],
    ) -> None:
        """Writes the MTP cache for tokens[b] at positions starts[b].., token j paired with hidden row
        first_rows[b] + j (the trunk's hidden state at the position before it), then drafts up to budgets[b]
        tokens per sequence (None: write its entries now and draft nothing, for a sequence that has finished).

        tokens[b] must end with the sequence's last token, so the last entry predicts the next one.
        """
        self._keep_boundaries(seqs, hidden, first_rows, tokens, starts)
        pieces = [
            self._with_lag(seq, hidden[first_rows[b] : first_rows[b] + len(tokens[b])], tokens[b], starts[b])
            for b, seq in enumerate(seqs)
        ]
        run = []
        for b, (seq, piece) in enumerate(zip(seqs, pieces)):
            if budgets[b] is not None and budgets[b] <= 0 and len(piece.tokens) < LAG_LIMIT:
                self._lag[seq.slot] = piece  # no drafts next step: the module can wait
                self._count[seq.slot] = 0
                self._end[seq.slot] = piece.start
            else:
                run.append(b)
                self._end[seq.slot] = piece.end
        if not run:
            return
        packed = torch.cat([pieces[b].hidden for b in run]) if len(run) > 1 else pieces[run[0]].hidden
        out = self.runner.mtp_forward(
            DRAFT_MODULE, packed, [pieces[b].tokens for b in run], [pieces[b].start for b in run],
            [seqs[b].slot for b in run],
        )  # [T', hidden]
        last = np.cumsum([len(pieces[b].tokens) for b in run]) - 1
        self.draft([seqs[b] for b in run], out[torch.from_numpy(last).to(out.device)], [budgets[b] or 0 for b in run])

    def _keep_boundaries(
        self, seqs: list[Sequence], hidden: Tensor, first_rows: list[int], tokens: list[list[int]], starts: list[int]
    ) -> None:
        """Keeps the trunk's hidden state at the last position of every block these rows complete, beside the
        block (KVCache.boundary_hidden): a sequence that later starts from the cached block pairs it with its next
        token, so a prefix cache hit drafts exactly as a cold prefill (no block is dropped to recompute it)."""
        cache = self.runner.cache
        block_size = cache.block_size
        rows, blocks = [], []
        for b, seq in enumerate(seqs):
            first = starts[b] - 1  # the position of hidden row first_rows[b]
            for position in range(first + (-(first + 1) % block_size), first + len(tokens[b]), block_size):
                rows.append(first_rows[b] + position - first)
                blocks.append(int(cache.block_tables[seq.slot, position // block_size]))
        if rows:
            device = hidden.device
            cache.boundary_hidden.index_copy_(
                0, torch.tensor(blocks, device=device), hidden[torch.tensor(rows, device=device)]
            )

    @property
    def window(self) -> int | None:
        """The drafting layer's sliding window: the trunk's for an MTP module; an EAGLE-3 head's layer, a Llama's,
        has none (it attends to every position)."""
        model = self.runner.model
        return model.config.attention_window if model.eagle3 is None else model.eagle3.config.layer.attention_window

    def boundary(self, seq: Sequence, position: int) -> Tensor:
        """The trunk's hidden state [hidden] at `position`, the last of one of the sequence's blocks."""
        cache = self.runner.cache
        return cache.boundary_hidden[int(cache.block_tables[seq.slot, position // cache.block_size])]

    def prefill_inputs(
        self, seqs: list[Sequence], hidden: Tensor, first_rows: np.ndarray, starts: list[int], rows: list[list[int]]
    ) -> tuple[Tensor, np.ndarray, list[list[int]], list[int]]:
        """catch_up's hidden states, first rows, tokens and start positions for a prefill pass whose rows[b] began at
        position starts[b] (hidden [T, hidden], sequence b's rows from first_rows[b]).

        Trunk row j of a piece (position start + j) pairs with the token at start + j + 1, which for a piece before
        the last is the next piece's first prompt token: each piece writes the module's entries up to where the next
        one starts, so the module sees every piece's hidden states. A sequence's first piece starts its slot anew; one
        past a cached or shared prefix pairs the token at its start with the trunk's state kept beside the prefix's
        last block."""
        pieces, firsts, tokens, positions, row = [], [], [], [], 0
        for b, (seq, start) in enumerate(zip(seqs, starts)):
            piece = hidden[first_rows[b] : first_rows[b + 1]]
            if start == seq.prefill_start:
                self.forget(seq.slot)
                if start:
                    piece = torch.cat([self.boundary(seq, start - 1)[None], piece])
                first = max(start, MTP_FIRST_POSITION)
            else:
                first = start + 1  # the piece before wrote the entry at its start
            pieces.append(piece)
            firsts.append(row)
            row += len(piece)
            tokens.append(seq.token_ids[first : start + len(rows[b]) + 1])
            positions.append(first)
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0], np.asarray(firsts), tokens, positions

    def computed_until(self, seq: Sequence) -> int:
        """Positions below this have the module's entries and, at a block's last one, the trunk's state kept beside
        the block: the module's entries end where its last token is, whose trunk state came with no token to pair
        (an echo-only prompt's last one), so the kept states stop one position earlier."""
        return max(self._end[seq.slot] - 1, 0)

    def forget(self, slot: int) -> None:
        """A slot starts over (a prefill): what an earlier occupant left waiting there is dropped."""
        self._lag.pop(slot, None)
        self._end[slot] = 0

    def export_slot(self, slot: int) -> MtpSlotState:
        """The slot's drafter state, copied to the host."""
        draft = self.pending_in(slot, self._count[slot])
        probs = draft.probs if draft.probs is not None else point_mass_rows(draft.tokens, self.vocab_size, "cpu")
        lag = self._lag.get(slot)
        return MtpSlotState(
            self._end[slot], draft.tokens, probs.cpu(), self._report[slot, : len(draft.tokens)].cpu(),
            None if lag is None else Lag(lag.start, lag.hidden.cpu(), lag.tokens),
        )

    def import_slot(self, slot: int, state: MtpSlotState) -> None:
        """Puts a sequence's drafter state, exported on another worker, into this slot."""
        count = len(state.draft_tokens)
        if count > self.num_steps:
            raise ValueError(f"{count} pending drafts exceed this drafter's {self.num_steps} steps")
        device = self._probs.device
        self._end[slot] = state.end
        self._count[slot] = count
        self._tokens[slot][:count] = state.draft_tokens
        self._probs[slot, :count] = state.draft_probs.to(device)
        self._point_mass[slot] = False
        self._report[slot, :count] = state.draft_report.to(device)
        self._lag.pop(slot, None)
        if state.lag is not None:
            self._lag[slot] = Lag(state.lag.start, state.lag.hidden.to(device), list(state.lag.tokens))

    def _with_lag(self, seq: Sequence, hidden: Tensor, tokens: list[int], start: int) -> Lag:
        """This catch-up's tokens, preceded by the sequence's lag if it ends where they begin (otherwise the lag
        belonged to an earlier occupant of the slot, or to the sequence before a preemption, and is dropped)."""
        lag = self._lag.pop(seq.slot, None)
        if lag is None or lag.end != start:
            return Lag(start, hidden.clone(), list(tokens))
        return Lag(lag.start, torch.cat([lag.hidden, hidden]), lag.tokens + list(tokens))

    @inference
    def draft(self, seqs: list[Sequence], hidden: Tensor, budgets: list[int]) -> None:
        """Drafts min(num_steps, budgets[b]) tokens from the module's hidden state at each sequence's last token
        [B, hidden]: step j's draft and hidden state are the module's input at the position after it. q and the noise
        are draft_sampling.py's. The bookkeeping stays on the host, in lists: on a small CPU every tensor op of a
        drafting pass costs about as much as the module's arithmetic."""
        num_steps = [min(self.num_steps, b) for b in budgets]
        for seq, count in zip(seqs, num_steps):
            self._count[seq.slot] = count
        rows = [b for b, count in enumerate(num_steps) if count > 0]
        device = self.runner.device
        for group, quantized in precision_groups(seqs, rows, self.int8):
            picked = hidden if len(group) == len(seqs) else hidden[torch.tensor(group, device=device)]
            self._chain([seqs[b] for b in group], picked, [num_steps[b] for b in group], quantized)

    def _chain(self, seqs: list[Sequence], hidden: Tensor, num_steps: list[int], quantized: bool) -> None:
        """Drafts num_steps[b] tokens for each of seqs from its hidden state [B, hidden], one module pass a draft;
        quantized: the logits and the self-fed passes through the int8 twins."""
        device = self.runner.device
        sampler = DraftSampler(seqs, device, self.grammars)
        rows = list(range(len(seqs)))
        for j in range(max(num_steps)):
            logits = self.runner.mtp_logits(DRAFT_MODULE, hidden, quantized=quantized)  # [A, vocab]
            chosen, q, report = sampler.step(logits, torch.tensor(rows, device=device), j)
            tokens = chosen.tolist()
            slots = [seqs[r].slot for r in rows]
            for slot, token in zip(slots, tokens):
                self._tokens[slot][j] = token
                self._point_mass[slot] = q is None  # greedy drafts: point masses, whose q needs no rows
            slot_ids = torch.tensor(slots, device=device)
            if q is not None:
                self._probs[slot_ids, j] = q
            self._report[slot_ids, j] = report
            if self.min_confidence > 0:
                for r, confidence in zip(rows, sampler.confidence(logits, chosen)):
                    if confidence < self.min_confidence and num_steps[r] > j + 1:
                        num_steps[r] = j + 1
                        self._count[seqs[r].slot] = j + 1
            going = [i for i, r in enumerate(rows) if num_steps[r] > j + 1]
            if not going:
                break
            if len(going) < len(rows):
                hidden = hidden[torch.tensor(going, device=device)]
                rows, tokens = [rows[i] for i in going], [tokens[i] for i in going]
            hidden = self.runner.mtp_forward(
                DRAFT_MODULE, hidden, [[t] for t in tokens], [seqs[r].num_tokens + j for r in rows],
                [seqs[r].slot for r in rows], quantized=quantized,
            )

    def pending(self, seq: Sequence, limit: int) -> Draft:
        """The sequence's drafts for this step, at most `limit` of them."""
        return self.pending_in(seq.slot, min(self._count[seq.slot], limit))

    def pending_in(self, slot: int, count: int) -> Draft:
        if count <= 0:
            return Draft([])
        probs = None if self._point_mass[slot] else self._probs[slot, :count].clone()
        return Draft(self._tokens[slot][:count], probs, self._report[slot, :count].clone())
