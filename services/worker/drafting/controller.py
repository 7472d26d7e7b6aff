"""How many drafts each sequence verifies per step, and the timing state that decision needs.

With a fixed budget every sequence gets num_speculative_tokens, or the lower number its request asked for (0 turns
speculation off for it), less what it may still emit. With adaptive speculation (drafting/adaptive.py) a
per-request model picks each request's drafts, never above that cap, from its acceptance and the measured step
cost, and a gate compares measured tokens/s with and without drafts per batch size, so a busy worker falls back
to plain decoding when drafting does not pay. The gate decides one step ahead: the MTP drafter prepares the next
step's drafts at the end of this one and must know then whether they will be used; its drafting time is charged
to the step it serves.

Plain-Python bookkeeping: the engine reports what happened, the controller answers budgets.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from shared.config import SpeculativeConfig
from services.worker.drafting.adaptive import AdaptiveSpeculation, SpeculationGate
from services.worker.engine.sequence import Sequence

CALIBRATION_MAX_ROWS = 32
CALIBRATION_REPEATS = 3
# The adaptive model's kinds of request, each with its own pooled acceptance: the same drafts are accepted far
# more often when the target's choice is its argmax than when it samples, and a constrained request's drafts include
# the tokens its grammar forces, always accepted (engine.py), which must not raise the others' estimates; a request
# with a prediction drafts from it (drafting/prediction.py), far more often accepted than prompt lookup.
GREEDY, SAMPLED, CONSTRAINED, PREDICTED = "greedy", "sampled", "constrained", "predicted"


class SpeculationController:
    def __init__(self, spec: SpeculativeConfig, max_model_len: int) -> None:
        self.max_drafts = spec.num_drafts
        self.max_model_len = max_model_len
        adaptive = spec.adaptive_drafts and spec.num_drafts > 0
        self.adaptive = AdaptiveSpeculation(spec.num_drafts) if adaptive else None
        self.gate = SpeculationGate() if adaptive else None
        self._chosen: dict[str, int] = {}
        self._speculate = self._speculate_next = True
        self._drafting_seconds = self._prepared_seconds = 0.0
        self._started = 0.0

    def calibrate(self, run_step: Callable[[int, int], None], max_num_seqs: int) -> None:
        """Times verify-shaped steps of a few sizes on the idle engine (run_step(rows, width) runs and waits for
        one), so adaptive speculation starts from this device's own ratio of per-token to fixed step cost:
        compute-bound CPUs and memory-bound GPUs differ by orders of magnitude, and the steps of one steady
        batch cannot tell the two costs apart."""
        if self.adaptive is None:
            return
        for num_rows in (1, min(max_num_seqs, CALIBRATION_MAX_ROWS)):
            for width in (1, 1 + self.max_drafts):
                for _ in range(CALIBRATION_REPEATS):
                    started = time.perf_counter()
                    run_step(num_rows, width)
                    self.adaptive.observe_step(num_rows, num_rows * (width - 1), time.perf_counter() - started)

    def budget(self, seq: Sequence, next_step: bool = False) -> int:
        """Drafts for the sequence's step (this one, or the next for the MTP drafter): at most the request's own
        num_speculative_tokens when it set one, and what it may still emit, less the token verification adds; with
        adaptive speculation, what its acceptance earns at the current batch size, and none in a step the gate keeps
        to plain decoding."""
        if self.max_drafts == 0 or not (self._speculate_next if next_step else self._speculate):
            return 0
        own = seq.sampling.speculative.num_speculative_tokens
        cap = self.max_drafts if own is None else min(own, self.max_drafts)
        budget = min(cap, seq.max_new_tokens(self.max_model_len) - 1)
        return min(budget, self._chosen.get(seq.key, budget))

    def begin_step(self, seqs: list[Sequence]) -> None:
        """A decode step over seqs starts: the adaptive model and the gate decide."""
        if self.adaptive is None:
            return
        self._speculate = self._speculate_next
        self._speculate_next = self.gate.speculate(len(seqs))
        for seq in seqs:
            self.adaptive.admit(seq.key, _kind(seq))
        self._chosen = self.adaptive.choose([s.key for s in seqs], len(seqs))
        self._prepared_seconds, self._drafting_seconds = self._prepared_seconds + self._drafting_seconds, 0.0
        self._started = time.perf_counter()

    def end_step(self, num_seqs: int, num_scored: int, num_emitted: int) -> None:
        """The decode step begun last ended, having scored num_scored tokens and emitted num_emitted: its time,
        with MTP drafting charged to the step it serves, feeds the cost model and the gate."""
        if self.adaptive is None:
            return
        prepared, self._prepared_seconds, self._drafting_seconds = self._prepared_seconds, self._drafting_seconds, 0.0
        seconds = time.perf_counter() - self._started - self._prepared_seconds + prepared
        self.adaptive.observe_step(num_seqs, num_scored - num_seqs, seconds)
        self.gate.observe(num_seqs, self._speculate, num_emitted, seconds)

    def charge_drafting(self, seconds: float) -> None:
        """Time spent drafting for the next step (MTP), charged to it."""
        self._drafting_seconds += seconds

    def observe(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        if self.adaptive is not None:
            self.adaptive.observe(seq.key, num_drafted, num_accepted)

    def forget(self, seq: Sequence) -> None:
        if self.adaptive is not None:
            self.adaptive.forget(seq.key)
            self._chosen.pop(seq.key, None)


def _kind(seq: Sequence) -> str:
    if seq.sampling.structured is not None:
        return CONSTRAINED
    if seq.sampling.speculative.prediction_token_ids:
        return PREDICTED
    return GREEDY if seq.sampling.greedy else SAMPLED
