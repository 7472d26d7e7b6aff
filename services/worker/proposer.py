"""Drafting methods behind one interface: given a sequence, propose up to k tokens to verify."""

from __future__ import annotations

from typing import Protocol

from shared.config import SpeculativeConfig
from services.worker.sequence import Sequence
from services.worker.spec.ngram import NgramProposer
from services.worker.spec.suffix import SuffixProposer


class Proposer(Protocol):
    def propose(self, seq: Sequence, num_drafts: int) -> list[int]: ...


class NaiveProposer:
    """The speculative code path with no drafts: every step verifies nothing and emits one token."""

    def propose(self, seq: Sequence, num_drafts: int) -> list[int]:
        return []


class PromptLookupProposer:
    """ngram: continue the longest recent n-gram match over the prompt and the generated tokens."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self._ngram = NgramProposer(config.max_ngram_size, config.min_ngram_size)

    def propose(self, seq: Sequence, num_drafts: int) -> list[int]:
        return self._ngram.propose(seq.token_ids, num_drafts) if num_drafts > 0 else []


def build_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "naive" or config.num_speculative_tokens == 0:
        return NaiveProposer()
    if config.method == "ngram":
        return PromptLookupProposer(config)
    if config.method == "suffix":
        return SuffixProposer(config)
    raise ValueError(f"unknown speculative method {config.method!r}")
