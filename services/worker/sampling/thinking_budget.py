"""vLLM's thinking_token_budget: a reasoning block of at most `budget` tokens, its closing tag forced after them.

Where the block stands is a function of the output so far (the prompt may have opened it): before it (the answer may
still open with the block, after line breaks), inside it (counting its tokens), or past it. Inside, with `budget`
tokens written, every token but the closing tag is masked: the mask is part of the target p at each scored row, the
drafts before the row counted as output, so speculation stays exact as it does under the penalties
(sampling/penalties.py applies it with them).

A sequence's scan of its accepted output is kept between steps (`scan_output`), so a step reads only its new tokens
and each row's drafts.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from shared.schemas import ThinkingBudget


class Phase(enum.Enum):
    BEFORE = "before"  # the answer may still open with the block
    INSIDE = "inside"
    PAST = "past"  # closed, or the answer began without it


@dataclass(frozen=True)
class Scan:
    """Where the block stands after `scanned` tokens of output."""

    phase: Phase
    thought: int  # tokens inside the block so far
    scanned: int

    @classmethod
    def start(cls, budget: ThinkingBudget) -> Scan:
        return cls(Phase.INSIDE if budget.starts_inside else Phase.BEFORE, 0, 0)

    def advance(self, budget: ThinkingBudget, tokens: Iterable[int]) -> Scan:
        phase, thought, scanned = self.phase, self.thought, self.scanned
        for token in tokens:
            scanned += 1
            if phase is Phase.BEFORE:
                if token == budget.open_id:
                    phase = Phase.INSIDE
                elif token not in budget.layout_ids:
                    phase = Phase.PAST
            elif phase is Phase.INSIDE:
                if token == budget.close_id:
                    phase = Phase.PAST
                else:
                    thought += 1
        return Scan(phase, thought, scanned)

    def forced(self, budget: ThinkingBudget) -> int | None:
        """The token the next position must be: the closing tag once the block holds `budget` tokens."""
        return budget.close_id if self.phase is Phase.INSIDE and self.thought >= budget.budget else None


def scan_output(budget: ThinkingBudget, output: list[int], kept: Scan | None) -> Scan:
    """The scan of the whole accepted output, from the one kept for a shorter prefix of it (None: from the start)."""
    if kept is None or kept.scanned > len(output):
        kept = Scan.start(budget)
    return kept.advance(budget, output[kept.scanned :])
