"""Predicted outputs (OpenAI's `prediction`): a request says what it expects most of its answer to be (a file to be
rewritten with a few edits), and its drafts come from that text, from wherever the answer stands in it
(shared/prediction.py's cursor).

The drafts are verified as every draft is, so the answer is the one the request would get without a prediction;
only the number of steps changes. Where the answer leaves the prediction (an edit), the prediction drafts nothing
until the answer's last tokens are found in it again, and the method's own proposer drafts meanwhile.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from services.worker.drafting.draft import Draft
from services.worker.drafting.proposer import Proposer
from services.worker.engine.sequence import Sequence
from shared.prediction import PredictionCursor


class PredictedOutputs:
    """Wraps the method's proposer: a sequence whose request has a prediction drafts from it while the answer follows
    it; the others, and it where its prediction drafts nothing, get the method's own drafts."""

    def __init__(self, inner: Proposer, max_ngram_size: int) -> None:
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
        cursor.advance(seq.output_ids)
        return cursor.next_tokens(budget)

    def on_finished(self, seq: Sequence) -> None:
        self._cursors.pop(seq.key, None)
        self._inner.on_finished(seq)
