"""Predicted outputs (OpenAI's `prediction`): a request says what it expects most of its answer to be (a file to be
rewritten with a few edits), and its drafts come from that text, from wherever the answer stands in it.

The drafts are verified as every draft is, so the answer is the one the request would get without a prediction;
only the number of steps changes. Where the answer leaves the prediction (an edit), the prediction drafts nothing
until the answer's last tokens are found in it again, and the method's own proposer drafts meanwhile.

Plain-Python bookkeeping on token lists, with numpy for the search.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from services.worker.drafting.draft import Draft
from services.worker.engine.sequence import Sequence

MIN_MATCH = 2  # the fewest of the answer's last tokens that place it in the prediction again after an edit


class PredictionCursor:
    """Where one answer stands in its prediction: the position of the answer's next token, while it follows."""

    def __init__(self, prediction: Seq[int], max_ngram_size: int) -> None:
        self._prediction = np.asarray(prediction, dtype=np.int64)
        self._max_match = max(max_ngram_size, MIN_MATCH)
        self._cursor = 0
        self._following = True  # the answer's tokens since the last anchor are the prediction's
        self._seen = 0  # of the answer's tokens

    def drafts(self, output: Seq[int], num_drafts: int) -> list[int]:
        """The prediction's next tokens after `output` (the answer so far), at most num_drafts."""
        new = np.asarray(output[self._seen :], dtype=np.int64)
        self._seen = len(output)
        ahead = self._prediction[self._cursor : self._cursor + len(new)]
        if self._following and len(ahead) == len(new) and np.array_equal(ahead, new):
            self._cursor += len(new)
        elif len(new):
            self._following = self._anchor(output)
        if not self._following or num_drafts <= 0:
            return []
        return self._prediction[self._cursor : self._cursor + num_drafts].tolist()

    def _anchor(self, output: Seq[int]) -> bool:
        """Finds the answer's last tokens (the most that match, max_ngram_size down to MIN_MATCH) in the prediction:
        their first occurrence from the cursor on, where an edit rejoins the prediction, else the first anywhere."""
        for size in range(min(self._max_match, len(output), len(self._prediction)), MIN_MATCH - 1, -1):
            tail = np.asarray(output[-size:], dtype=np.int64)
            starts = np.flatnonzero((sliding_window_view(self._prediction, size) == tail).all(axis=1))
            if len(starts):
                ahead = starts[starts >= self._cursor]
                self._cursor = int((ahead if len(ahead) else starts)[0]) + size
                return True
        return False


class PredictedOutputs:
    """Wraps the method's proposer: a sequence whose request has a prediction drafts from it while the answer follows
    it; the others, and it where its prediction drafts nothing, get the method's own drafts."""

    def __init__(self, inner, max_ngram_size: int) -> None:
        self._inner = inner
        self._max_ngram_size = max_ngram_size
        self._cursors: dict[str, PredictionCursor] = {}

    def propose_batch(self, seqs: Seq[Sequence], budgets: Seq[int]) -> list[Draft]:
        predicted = [self._drafts(seq, budget) for seq, budget in zip(seqs, budgets)]
        drafts = self._inner.propose_batch(seqs, [0 if p else b for p, b in zip(predicted, budgets)])
        return [Draft(p) if p else draft for p, draft in zip(predicted, drafts)]

    def _drafts(self, seq: Sequence, budget: int) -> list[int]:
        prediction = seq.sampling.speculative.prediction_token_ids
        if not prediction:
            return []
        cursor = self._cursors.get(seq.key)
        if cursor is None:
            cursor = self._cursors[seq.key] = PredictionCursor(prediction, self._max_ngram_size)
        return cursor.drafts(seq.output_ids, budget)

    def on_finished(self, seq: Sequence) -> None:
        self._cursors.pop(seq.key, None)
        self._inner.on_finished(seq)
