"""Where an answer stands in its prediction (OpenAI's predicted outputs), step by step: what a worker drafts from
(services/worker/drafting/prediction.py), and what the detokenizer counts for usage's `completion_tokens_details`.

While the answer follows the prediction, its next token is expected at the cursor. Where it leaves (an edit), its
last tokens (max_ngram_size down to MIN_MATCH) are looked up in an index of the prediction's token pairs, built
once: the longest match wins, the first from the cursor on (where an edit rejoins the prediction), else the first
anywhere. A lookup costs a dict access and at most MAX_CANDIDATES short comparisons, whatever the prediction's
length or repetitiveness, so neither a worker's step nor the detokenizer's count grows with it.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Sequence

from shared.schemas import CompletionTokensDetails

MIN_MATCH = 2  # the fewest of the answer's last tokens that place it in the prediction again
MAX_CANDIDATES = 16  # occurrences of a pair compared, from the cursor on and from the start each


class PredictionCursor:
    """One answer's place in its prediction; `advance` with the answer's tokens as they come."""

    def __init__(self, prediction: Sequence[int], max_ngram_size: int) -> None:
        self.prediction = list(prediction)
        self._max_match = max(max_ngram_size, MIN_MATCH)
        self._pairs: dict[tuple[int, int], list[int]] = defaultdict(list)  # pair -> where it starts, ascending
        for i in range(len(self.prediction) - 1):
            self._pairs[self.prediction[i], self.prediction[i + 1]].append(i)
        self.cursor = 0  # where the answer's next token is expected
        self.following = True
        self.matched: set[int] = set()  # positions of the prediction the answer had, in order, one per answer token
        self._seen = 0  # answer tokens advanced over
        self._counted = 0  # answer tokens before this one have a matched position, or none

    def advance(self, answer: Sequence[int]) -> None:
        """Takes the answer's tokens since the last call (`answer` is the whole answer so far)."""
        for i in range(self._seen, len(answer)):
            token = answer[i]
            if self.following and self.cursor < len(self.prediction) and self.prediction[self.cursor] == token:
                self.matched.add(self.cursor)
                self.cursor += 1
                self._counted = i + 1
            else:
                self.following = self._anchor(answer, i + 1)
        self._seen = len(answer)

    def next_tokens(self, count: int) -> list[int]:
        """The prediction's next `count` tokens at most, while the answer follows it."""
        return self.prediction[self.cursor : self.cursor + count] if self.following and count > 0 else []

    def _anchor(self, answer: Sequence[int], end: int) -> bool:
        """Places the cursor after the longest match of answer[:end]'s last tokens; False where none is found."""
        if end < MIN_MATCH:
            return False
        starts = self._pairs.get((answer[end - 2], answer[end - 1]))
        if not starts:
            return False
        ahead = bisect.bisect_left(starts, self.cursor)
        candidates = [*starts[ahead : ahead + MAX_CANDIDATES], *starts[:MAX_CANDIDATES]]
        best, best_length = None, 0
        for start in candidates:  # ordered: from the cursor on first, then from the start
            length = MIN_MATCH
            while (length < self._max_match and length < end and start - (length - MIN_MATCH) > 0
                   and self.prediction[start - (length - MIN_MATCH) - 1] == answer[end - length - 1]):
                length += 1
            if length > best_length:
                best, best_length = start, length
        # The answer's last tokens were found there: those not matched yet count.
        uncounted = min(best_length, end - self._counted)
        self.matched.update(range(best + MIN_MATCH - uncounted, best + MIN_MATCH))
        self._counted = end
        self.cursor = best + MIN_MATCH
        return True


def prediction_usage(
    prediction: Sequence[int], answer: Sequence[int], max_ngram_size: int = 5
) -> CompletionTokensDetails:
    """OpenAI's accepted and rejected prediction tokens: the prediction's tokens the answer had, in order, as the
    cursor followed it, and the rest."""
    cursor = PredictionCursor(prediction, max_ngram_size)
    cursor.advance(answer)
    accepted = len(cursor.matched)
    return CompletionTokensDetails(
        accepted_prediction_tokens=accepted, rejected_prediction_tokens=len(prediction) - accepted
    )
