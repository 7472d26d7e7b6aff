"""Prompt lookup for a whole batch on the device: the ngram method's proposer on CUDA.

On the host, prompt lookup runs once per sequence over its token list (drafting/ngram.py); at batch 64 that is
64 numpy calls a step. Here every slot's tokens live in one device matrix, appended incrementally (each step
uploads only the tokens that are new since the slot's last proposal), and one launch of the Triton kernel
(drafting/ngram_batch.py -> kernels/ngram.py) drafts for every sequence; the drafts come back in one copy.
The proposals are the host proposer's, token for token (the kernel's twin is NgramProposer itself), so
switching between the two never changes output, only where the work runs.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np
import torch

from shared.config import SpeculativeConfig
from services.worker.drafting.draft import Draft
from services.worker.drafting.ngram_batch import ngram_propose
from services.worker.engine.host_copy import fetch
from services.worker.engine.sequence import Sequence


class DeviceNgramProposer:
    """ngram: the longest recent n-gram match, for every sequence of the step in one launch."""

    def __init__(self, config: SpeculativeConfig, max_num_seqs: int, max_model_len: int, device: torch.device) -> None:
        self.k = config.num_speculative_tokens
        self.max_ngram_size, self.min_ngram_size = config.max_ngram_size, config.min_ngram_size
        self.device = torch.device(device)
        self.tokens = torch.zeros(max_num_seqs, max_model_len, dtype=torch.int64, device=self.device)
        # Per slot: the sequence whose tokens the matrix row holds (choices of one request share an id, so the
        # sequence itself) and how many of them are there.
        self._owner: list[Sequence | None] = [None] * max_num_seqs
        self._synced = [0] * max_num_seqs

    def propose(self, seq: Sequence, num_drafts: int) -> Draft:
        return self.propose_batch([seq], [num_drafts])[0]

    def propose_batch(self, seqs: Seq[Sequence], budgets: Seq[int]) -> list[Draft]:
        """Up to budgets[b] drafts for each sequence (point masses)."""
        live = [b for b, budget in enumerate(budgets) if budget > 0]
        drafts = [Draft([]) for _ in seqs]
        if not live:
            return drafts
        slots = np.array([seqs[b].slot for b in live], dtype=np.int64)
        lengths = np.array([seqs[b].num_tokens for b in live], dtype=np.int64)
        self._sync([seqs[b] for b in live])
        width = int(lengths.max())
        rows = self.tokens[torch.from_numpy(slots).to(self.device), :width]  # [B', width]
        proposed, counts = ngram_propose(
            rows, torch.from_numpy(lengths).to(self.device),
            torch.tensor([budgets[b] for b in live], dtype=torch.int64, device=self.device),
            self.k, self.max_ngram_size, self.min_ngram_size,
        )
        proposed, counts = fetch([proposed, counts])
        for i, b in enumerate(live):
            drafts[b] = Draft(proposed[i, : counts[i]].tolist())
        return drafts

    def _sync(self, seqs: list[Sequence]) -> None:
        """Writes each sequence's tokens that its slot's row lacks, in one scatter."""
        slots, positions, values = [], [], []
        for seq in seqs:
            slot = seq.slot
            if self._owner[slot] is not seq:  # a new sequence in the slot: its row starts over
                self._owner[slot], self._synced[slot] = seq, 0
            start = self._synced[slot]
            new = seq.prompt_ids[start:] + seq.output_ids[max(0, start - len(seq.prompt_ids)) :]
            if new:
                slots.append(np.full(len(new), slot, dtype=np.int64))
                positions.append(np.arange(start, start + len(new), dtype=np.int64))
                values.append(np.asarray(new, dtype=np.int64))
                self._synced[slot] = start + len(new)
        if not slots:
            return
        staged = torch.from_numpy(np.stack([np.concatenate(a) for a in (slots, positions, values)])).to(self.device)
        self.tokens[staged[0], staged[1]] = staged[2]

    def on_finished(self, seq: Sequence) -> None:
        if seq.slot is not None and self._owner[seq.slot] is seq:
            self._owner[seq.slot] = None
