"""Drafting methods behind one interface: given the step's sequences, propose up to budgets[b] tokens each to
verify, with the distribution q they were drawn from (None for point-mass proposals)."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Protocol

import torch

from shared.config import SpeculativeConfig
from services.worker.drafting.draft import Draft, point_mass_rows
from services.worker.engine.sequence import Sequence
from services.worker.drafting.mtp import MtpDrafter
from services.worker.drafting.ngram import NgramProposer
from services.worker.drafting.ngram_device import DeviceNgramProposer
from services.worker.drafting.suffix import SuffixProposer


class Proposer(Protocol):
    def propose_batch(self, seqs: Seq[Sequence], budgets: Seq[int]) -> list[Draft]: ...

    def on_finished(self, seq: Sequence) -> None:
        """Called once when a running sequence finishes or is aborted."""


class PerSequence:
    """Mixin of the proposers that draft for one sequence at a time on the host (their `propose`)."""

    def propose_batch(self, seqs: Seq[Sequence], budgets: Seq[int]) -> list[Draft]:
        return [self.propose(seq, budget) for seq, budget in zip(seqs, budgets)]


class NaiveProposer(PerSequence):
    """The speculative code path with no drafts: every step verifies nothing and emits one token."""

    def propose(self, seq: Sequence, num_drafts: int) -> Draft:
        return Draft([])

    def on_finished(self, seq: Sequence) -> None:
        pass


class TokenListProposer(PerSequence):
    """Adapts a proposer of bare token ids (suffix decoding) to Draft: its proposals are point masses."""

    def __init__(self, inner: SuffixProposer) -> None:
        self._inner = inner

    def propose(self, seq: Sequence, num_drafts: int) -> Draft:
        return Draft(self._inner.propose(seq, num_drafts))

    def on_finished(self, seq: Sequence) -> None:
        self._inner.on_finished(seq)


class PromptLookupProposer(PerSequence):
    """ngram: continue the longest recent n-gram match over the prompt and the generated tokens."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self._ngram = NgramProposer(config.max_ngram_size, config.min_ngram_size)

    def propose(self, seq: Sequence, num_drafts: int) -> Draft:
        return Draft(self._ngram.propose(seq.token_ids, num_drafts) if num_drafts > 0 else [])

    def on_finished(self, seq: Sequence) -> None:
        pass


class MtpProposer(PerSequence):
    """mtp: the drafts the MTP module computed at the end of the last step (MtpDrafter).

    With mtp_strategy "with_ngram", prompt lookup over the sequence and the MTP drafts fills the rest of the
    budget; those tokens are point masses, so their q rows are one-hot.
    """

    def __init__(self, drafter: MtpDrafter, config: SpeculativeConfig) -> None:
        self._drafter = drafter
        self._real_q = config.draft_q == "model"
        with_ngram = config.mtp_strategy == "with_ngram"
        self._filler = NgramProposer(config.max_ngram_size, config.min_ngram_size) if with_ngram else None

    def propose(self, seq: Sequence, num_drafts: int) -> Draft:
        draft = self._drafter.pending(seq, num_drafts)
        if not self._real_q:
            draft = Draft(draft.tokens, None, draft.report_logits)  # verified as point masses
        room = num_drafts - len(draft.tokens)
        # The filler follows the module's own drafts only, verified against their real q.
        if self._filler is None or room <= 0 or not draft.tokens or not self._real_q:
            return draft
        extra = self._filler.propose(seq.token_ids + draft.tokens, room)
        if not extra:
            return draft
        if draft.probs is None:  # every draft a point mass already
            return Draft(draft.tokens + extra, None, draft.report_logits)
        one_hot = point_mass_rows(extra, draft.probs.shape[1], draft.probs.device)
        return Draft(draft.tokens + extra, torch.cat([draft.probs, one_hot]), draft.report_logits)

    def on_finished(self, seq: Sequence) -> None:
        pass  # the next sequence in its slot overwrites its pending drafts at prefill


def build_proposer(
    config: SpeculativeConfig, mtp: MtpDrafter | None = None, device: torch.device | str = "cpu",
    max_num_seqs: int = 0, max_model_len: int = 0,
) -> Proposer:
    """mtp: the engine's MTP drafter, required for methods "mtp" and "eagle3". On CUDA, prompt lookup drafts for the
    whole batch in one kernel launch (max_num_seqs and max_model_len size its token matrix); elsewhere on the host."""
    if config.method == "naive" or config.num_speculative_tokens == 0:
        return NaiveProposer()
    if config.method == "ngram":
        if torch.device(device).type == "cuda":
            return DeviceNgramProposer(config, max_num_seqs, max_model_len, device)
        return PromptLookupProposer(config)
    if config.method == "suffix":
        return TokenListProposer(SuffixProposer(config))
    if config.method in ("mtp", "eagle3"):
        if mtp is None:
            raise ValueError(f'method "{config.method}" needs the drafter of its MTP modules or EAGLE-3 head')
        return MtpProposer(mtp, config)
    raise ValueError(f"unknown speculative method {config.method!r}")
