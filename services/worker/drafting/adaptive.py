"""Adaptive speculation: how many drafts each request verifies this step, so that speculation never costs more
than it saves. At large batches a step's cost grows with the tokens it scores and rejected drafts are pure
overhead (vLLM measured n-gram speculation 1.8x slower than plain decoding at high load).

Model: a request whose drafts are each accepted with probability alpha (given the ones before were) emits
(1 - alpha^(k+1)) / (1 - alpha) tokens per step with k drafts; a step over S sequences with D draft rows in all
costs c0 + c_seq * S + c_draft * D. A sequence and a draft row cost differently: a sequence brings its own context
to attend over, its sampling and its host bookkeeping, a draft row of a sequence already in the step only one
more query over the same context (on a 2-core CPU the demo model's marginal draft row measured ~0.035 ms against
~0.17 ms per sequence; one coefficient for both made drafts look five times dearer than they are, and adaptive
speculation drafted a quarter of what paid at batch 32). The policy maximises emitted tokens per unit cost.
Starting from no drafts at all (plain decoding), it adds drafts one at a time, best marginal gain alpha^(k+1)
first, while each one raises the throughput; gains only shrink, so the first draft that does not pay ends the
search, and the result is never below plain decoding under the model. Only ratios matter, so an uncalibrated
prior ratio is enough to start; `observe_step` fits the coefficients from the engine's own step timings.

A new request's acceptance starts from what the worker's recent requests of its class (greedy or sampled: the
same drafts are kept far more often at temperature 0) were measured to accept, not from a fixed guess: on text
the drafter cannot predict, a fixed 0.6 made every new request try a few drafts before its own estimate fell, and
on text it predicts well, start below what it earns. That pooled estimate drifts back to the fixed prior while
no request of its class drafts, so a worker that stopped drafting tries again after a while.

Plain-Python bookkeeping on the host; no tensors.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

DEFAULT_PRIOR_WEIGHT = 4.0  # the prior acceptance counts as this many observed draft positions
DEFAULT_MEMORY = 0.9  # per observation, a request's earlier evidence keeps this weight: text changes character
# Per step without drafts, a request's estimate keeps this much of its distance from its kind's pooled estimate,
# so a request that lost its drafts to a bad stretch tries again once its kind's requests are drafting well (and the
# pool itself drifts back to the fixed prior while none drafts: a lone request waits for that, some hundreds of steps).
IDLE_RELAXATION = 0.98
# The pooled estimate of a kind of request: per verified request-step of any of them, earlier evidence keeps this
# weight (about the last hundred count: a couple of engine steps at batch 64, a hundred at batch 1); per engine step,
# it keeps this much of its distance from the fixed prior.
POOL_MEMORY = 0.99
POOL_RELAXATION = 0.998
# Before steps are timed: one more token costs 2% of a step's fixed cost, as in memory-bound decoding on an
# accelerator where weights, not tokens, dominate a small batch.
DEFAULT_TOKEN_COST_RATIO = 0.02
_CERTAIN = 1.0 - 1e-12  # alpha at or above this is treated as 1 (every draft accepted)
_MIN_SPREAD = 1e-9  # relative variance of a count below which timings cannot tell its cost from the fixed one
# 1 - (correlation of sequences and draft rows)^2 below which the two move together too closely to be told apart
_MIN_INDEPENDENCE = 1e-3


def expected_tokens(alpha: float, num_drafts: int) -> float:
    """Tokens one step emits with num_drafts drafts each accepted with probability alpha: accepted plus one."""
    if alpha >= _CERTAIN:
        return num_drafts + 1.0
    return (1.0 - alpha ** (num_drafts + 1)) / (1.0 - alpha)


def modelled_throughput(
    alphas: list[float], drafts: list[int], other_seqs: int, c0: float, c_seq: float, c_draft: float
) -> float:
    """Tokens per unit cost of one step: the requests' expected tokens, plus one per sequence without drafts."""
    emitted = sum(map(expected_tokens, alphas, drafts)) + other_seqs
    return emitted / (c0 + c_seq * (len(drafts) + other_seqs) + c_draft * sum(drafts))


class StepCostModel:
    """Step time ~ c0 + c_seq * sequences + c_draft * draft rows, by least squares over running (optionally
    exponentially forgotten) sums. What the timings cannot separate falls back, in order: a steady batch (the
    sequences never vary) fits the draft rows alone, its sequences' cost folded into c0; steps that never draft
    fit the sequences and price a draft row like a sequence; a single shape scales the prior ratio to the mean."""

    def __init__(self, token_cost_ratio: float = DEFAULT_TOKEN_COST_RATIO, forgetting: float = 1.0) -> None:
        if token_cost_ratio < 0 or not 0 < forgetting <= 1:
            raise ValueError(
                f"need token_cost_ratio >= 0 and 0 < forgetting <= 1, got {token_cost_ratio}, {forgetting}"
            )
        self.token_cost_ratio = token_cost_ratio
        self.forgetting = forgetting
        self._weight = 0.0
        self._mean = [0.0, 0.0, 0.0]  # sequences, draft rows, seconds
        # Weighted sums of products of deviations from the means: (seq, seq), (seq, draft), (draft, draft),
        # (seq, seconds), (draft, seconds).
        self._ss = self._sd = self._dd = self._st = self._dt = 0.0

    @property
    def num_observations(self) -> float:
        return self._weight

    def observe(self, num_seqs: int, num_drafts: int, seconds: float) -> None:
        """One step over num_seqs sequences that scored num_drafts draft rows besides them."""
        # West's weighted update: older weights shrink by `forgetting`, which scales the sums but not the means.
        f = self.forgetting
        self._weight = f * self._weight + 1.0
        observed = (num_seqs, num_drafts, seconds)
        before = [x - mean for x, mean in zip(observed, self._mean)]
        self._mean = [mean + d / self._weight for mean, d in zip(self._mean, before)]
        after = [x - mean for x, mean in zip(observed, self._mean)]
        self._ss = f * self._ss + before[0] * after[0]
        self._sd = f * self._sd + before[0] * after[1]
        self._dd = f * self._dd + before[1] * after[1]
        self._st = f * self._st + before[0] * after[2]
        self._dt = f * self._dt + before[1] * after[2]

    @property
    def coefficients(self) -> tuple[float, float, float]:
        """(c0, c_seq, c_draft), none negative."""
        mean_s, mean_d, mean_t = self._mean
        weight = self._weight
        seqs_vary = weight and self._ss / weight > _MIN_SPREAD * max(1.0, mean_s**2)
        drafts_vary = weight and self._dd / weight > _MIN_SPREAD * max(1.0, mean_d**2)
        det = self._ss * self._dd - self._sd**2
        if seqs_vary and drafts_vary and det > _MIN_INDEPENDENCE * self._ss * self._dd:
            c_seq = max((self._st * self._dd - self._dt * self._sd) / det, 0.0)
            c_draft = max((self._dt * self._ss - self._st * self._sd) / det, 0.0)
        elif drafts_vary:
            c_seq, c_draft = 0.0, max(self._dt / self._dd, 0.0)
        elif seqs_vary:  # no drafts to time, or always in step with the sequences: a row is a row
            rows_ss = self._ss + 2 * self._sd + self._dd
            c_seq = c_draft = max((self._st + self._dt) / rows_ss, 0.0)
        else:
            return self._prior(mean_t if weight else 1.0)
        c0 = max(mean_t - c_seq * mean_s - c_draft * mean_d, 0.0)
        if c0 == c_seq == c_draft == 0.0:  # timings that fit nothing
            return self._prior(mean_t)
        return c0, c_seq, c_draft

    def _prior(self, mean_seconds: float) -> tuple[float, float, float]:
        """The prior ratio (a sequence and a draft row each token_cost_ratio of c0), scaled so that the mean
        observed step costs mean_seconds."""
        c0 = mean_seconds / (1.0 + self.token_cost_ratio * (self._mean[0] + self._mean[1]))
        return c0, self.token_cost_ratio * c0, self.token_cost_ratio * c0


@dataclass
class _Acceptance:
    """Exponentially weighted accepted / tried draft positions, started at a prior's pseudo-counts."""

    accepted: float
    tried: float

    @property
    def alpha(self) -> float:
        return self.accepted / self.tried

    def remember(self, memory: float, accepted: float, tried: float) -> None:
        self.accepted = memory * self.accepted + accepted
        self.tried = memory * self.tried + tried

    def relax_towards(self, accepted: float, tried: float, kept: float) -> None:
        """Keeps `kept` of the distance from these pseudo-counts."""
        self.accepted = accepted + kept * (self.accepted - accepted)
        self.tried = tried + kept * (self.tried - tried)


@dataclass
class _Request:
    estimate: _Acceptance
    pool: _Acceptance  # its class's pooled estimate, which it feeds and relaxes towards


class AdaptiveSpeculation:
    def __init__(
        self,
        max_drafts: int,
        prior_acceptance: float = 0.6,
        prior_weight: float = DEFAULT_PRIOR_WEIGHT,
        memory: float = DEFAULT_MEMORY,
        cost: StepCostModel | None = None,
    ) -> None:
        if max_drafts < 0 or not 0 <= prior_acceptance <= 1 or prior_weight <= 0 or not 0 < memory <= 1:
            raise ValueError(
                f"need max_drafts >= 0, 0 <= prior_acceptance <= 1, prior_weight > 0, 0 < memory <= 1; got "
                f"{max_drafts}, {prior_acceptance}, {prior_weight}, {memory}"
            )
        self.max_drafts = max_drafts
        self.memory = memory
        self._prior = _Acceptance(prior_acceptance * prior_weight, prior_weight)
        self.cost = cost if cost is not None else StepCostModel()
        self._pools: dict[str, _Acceptance] = {}
        self._requests: dict[str, _Request] = {}

    def admit(self, request_id: str, kind: str = "") -> None:
        """A request of this kind (greedy or sampled, say) that the model has not seen: its estimate starts from
        the kind's pooled one, weighted like the prior. A request never admitted is of kind "" when first seen."""
        if request_id in self._requests:
            return
        pool = self._pools.get(kind)
        if pool is None:
            pool = self._pools[kind] = _Acceptance(self._prior.accepted, self._prior.tried)
        self._requests[request_id] = _Request(_Acceptance(pool.alpha * self._prior.tried, self._prior.tried), pool)

    def acceptance(self, request_id: str) -> float:
        """The request's estimated per-draft acceptance rate (its kind's pooled one before any observation)."""
        self.admit(request_id)
        return self._requests[request_id].estimate.alpha

    def pooled_acceptance(self, kind: str = "") -> float:
        """What a new request of this kind starts from."""
        pool = self._pools.get(kind)
        return (self._prior if pool is None else pool).alpha

    def choose(self, request_ids: list[str], batch_size: int) -> dict[str, int]:
        """Drafts per request for this step. batch_size: sequences in the verify pass, the requests here
        included; the others score one token each without drafts."""
        if batch_size < len(request_ids):
            raise ValueError(f"batch_size {batch_size} is smaller than the {len(request_ids)} requests to choose for")
        for pool in self._pools.values():
            pool.relax_towards(self._prior.accepted, self._prior.tried, POOL_RELAXATION)
        c0, c_seq, c_draft = self.cost.coefficients
        alphas = [self.acceptance(r) for r in request_ids]
        drafts = [0] * len(request_ids)
        emitted, cost = float(batch_size), c0 + c_seq * batch_size
        gains = [(-alpha, i) for i, alpha in enumerate(alphas) if alpha > 0 and self.max_drafts > 0]
        heapq.heapify(gains)
        while gains:
            neg_gain, i = heapq.heappop(gains)
            # One more draft pays iff (emitted + gain) / (cost + c_draft) > emitted / cost.
            if -neg_gain * cost <= emitted * c_draft:
                break
            drafts[i] += 1
            emitted, cost = emitted - neg_gain, cost + c_draft
            if drafts[i] < self.max_drafts:
                heapq.heappush(gains, (neg_gain * alphas[i], i))
        for request_id, k in zip(request_ids, drafts):
            if k == 0:
                self._relax(self._requests[request_id])
        return dict(zip(request_ids, drafts))

    def observe(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        """One verified step: num_accepted of num_drafted drafts (a prefix) were accepted."""
        if not 0 <= num_accepted <= num_drafted:
            raise ValueError(f"need 0 <= num_accepted <= num_drafted, got {num_accepted} of {num_drafted}")
        if num_drafted == 0:
            return
        # The drafts after the first rejection were never tried: they say nothing about alpha.
        tried = num_accepted + (1 if num_accepted < num_drafted else 0)
        self.admit(request_id)
        request = self._requests[request_id]
        request.estimate.remember(self.memory, num_accepted, tried)
        request.pool.remember(POOL_MEMORY, num_accepted, tried)

    def observe_step(self, num_seqs: int, num_drafts: int, seconds: float) -> None:
        """Timing of one step over num_seqs sequences that scored num_drafts draft rows besides them."""
        self.cost.observe(num_seqs, num_drafts, seconds)

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def _relax(self, request: _Request) -> None:
        """Towards its kind's pooled acceptance, weighted like the prior."""
        weight = self._prior.tried
        request.estimate.relax_towards(request.pool.alpha * weight, weight, IDLE_RELAXATION)


PROBE_EVERY = 16  # one decode step in this many runs the mode that is currently losing, to keep measuring it
GATE_MEMORY = 0.8  # weight an observed rate keeps per new observation of the same mode and batch size


class SpeculationGate:
    """Measured backstop for the cost model: per batch size (rounded to a power of two), an exponentially
    weighted tokens-per-second of decode steps with speculation and without; speculation runs only while it is
    measured to be the faster one. Whatever the model gets wrong (costs it does not see, a wrong acceptance
    estimate), a busy worker then runs at the speed of plain decoding, less the occasional probe step."""

    def __init__(self, probe_every: int = PROBE_EVERY, memory: float = GATE_MEMORY) -> None:
        self.probe_every = probe_every
        self.memory = memory
        self._rates: dict[tuple[int, bool], float] = {}
        self._steps: dict[int, int] = {}

    @staticmethod
    def _bucket(batch_size: int) -> int:
        return 1 << (batch_size - 1).bit_length()

    def speculate(self, batch_size: int) -> bool:
        """Whether this step may draft: unmeasured modes are tried first, then the faster, with probes."""
        bucket = self._bucket(batch_size)
        step = self._steps.get(bucket, 0)
        self._steps[bucket] = step + 1
        with_drafts, without = self._rates.get((bucket, True)), self._rates.get((bucket, False))
        if with_drafts is None or without is None:
            return without is not None  # measure plain decoding first, then speculation
        faster = with_drafts >= without
        return (not faster) if (step + 1) % self.probe_every == 0 else faster

    def observe(self, batch_size: int, speculated: bool, num_tokens: int, seconds: float) -> None:
        key = (self._bucket(batch_size), speculated)
        rate = num_tokens / max(seconds, 1e-9)
        old = self._rates.get(key)
        self._rates[key] = rate if old is None else self.memory * old + (1 - self.memory) * rate
