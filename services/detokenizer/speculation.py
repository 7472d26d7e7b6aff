"""A request's own speculation counts, for `usage.speculative`: one DRAFT record per step that drafted, whose
num_tokens are the drafts and num_accepted the accepted prefix of them.

Counting here rather than in the worker keeps the summary whole when a request moves between workers: only the
records the detokenizer consumed (duplicates of a resumed request are dropped before they get here) are counted.
"""

from __future__ import annotations

from collections.abc import Iterable

from shared.schemas import SpeculativeUsage

NO_SPECULATION_LENGTH = 1.0  # a step that verifies nothing emits one token


class SpeculationTally:
    def __init__(self) -> None:
        self.drafted: list[int] = []  # [position] drafts made at that position of a step
        self.accepted: list[int] = []  # [position] of those, accepted
        self.histogram: list[int] = []  # [j] steps that accepted exactly j drafts

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """One step's drafts: num_accepted of num_drafted were accepted (a prefix)."""
        if not 0 <= num_accepted <= num_drafted:
            raise ValueError(f"need 0 <= num_accepted <= num_drafted, got {num_accepted} of {num_drafted}")
        if not num_drafted:
            return
        _grow(self.drafted, num_drafted)
        _grow(self.accepted, num_drafted)
        _grow(self.histogram, num_drafted + 1)
        for position in range(num_drafted):
            self.drafted[position] += 1
            self.accepted[position] += position < num_accepted
        self.histogram[num_accepted] += 1

    @classmethod
    def of(cls, usage: SpeculativeUsage) -> SpeculationTally:
        """The counts behind a summary, so that the summaries of several requests (a prompt list) add up."""
        tally = cls()
        tally.drafted = list(usage.num_draft_tokens_per_position)
        tally.accepted = list(usage.num_accepted_tokens_per_position)
        tally.histogram = list(usage.acceptance_histogram)
        return tally

    @classmethod
    def merged(cls, tallies: Iterable[SpeculationTally]) -> SpeculationTally:
        """The counts of several choices of one request together."""
        total = cls()
        for tally in tallies:
            for mine, theirs in ((total.drafted, tally.drafted), (total.accepted, tally.accepted),
                                 (total.histogram, tally.histogram)):  # fmt: skip
                _grow(mine, len(theirs))
                for i, count in enumerate(theirs):
                    mine[i] += count
        return total

    def usage(self) -> SpeculativeUsage:
        steps = sum(self.histogram)
        drafted, accepted = sum(self.drafted), sum(self.accepted)
        return SpeculativeUsage(
            num_spec_steps=steps,
            num_draft_tokens=drafted,
            num_accepted_draft_tokens=accepted,
            mean_acceptance_length=NO_SPECULATION_LENGTH + accepted / steps if steps else NO_SPECULATION_LENGTH,
            draft_acceptance_rate=accepted / drafted if drafted else 0.0,
            num_draft_tokens_per_position=tuple(self.drafted),
            num_accepted_tokens_per_position=tuple(self.accepted),
            acceptance_rate_per_position=tuple(a / d for a, d in zip(self.accepted, self.drafted)),
            acceptance_histogram=tuple(self.histogram),
        )


def _grow(counts: list[int], length: int) -> None:
    counts.extend([0] * (length - len(counts)))
