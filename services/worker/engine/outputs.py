"""What an engine step hands the publisher: per sequence the tokens it emitted, their logprob arrays and what was
drafted; and the engine's running speculation counters."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from shared.frames import NO_TOKEN, FinishReason
from services.worker.engine.sequence import Sequence

NOT_COMPUTED_LOGPROB = float("nan")  # a request that did not ask for logprobs gets none computed
NOT_COMPUTED_RANK = 0
POINT_MASS_LOGPROB = 0.0  # log 1: a point-mass proposal puts all its mass on the drafted token
POINT_MASS_RANK = 1


@dataclass
class TokenLogprobs:
    """Frame-ready arrays for n tokens: ids and logprobs [n, top_k + 1] (slot 0 = the token), ranks [n]."""

    token_ids: np.ndarray
    logprobs: np.ndarray
    ranks: np.ndarray

    def head(self, n: int) -> "TokenLogprobs":
        """The arrays of the first n tokens."""
        return TokenLogprobs(self.token_ids[:n], self.logprobs[:n], self.ranks[:n])

    @classmethod
    def tokens_only(cls, tokens: list[int], top_k: int) -> "TokenLogprobs":
        """The arrays of a request that asked for no logprobs: the tokens in slot 0, nothing computed."""
        ids = np.full((len(tokens), top_k + 1), NO_TOKEN, dtype=np.int32)
        ids[:, 0] = tokens
        logprobs = np.full((len(tokens), top_k + 1), NOT_COMPUTED_LOGPROB, dtype=np.float32)
        return cls(ids, logprobs, np.full(len(tokens), NOT_COMPUTED_RANK, dtype=np.int32))


    @classmethod
    def point_masses(cls, tokens: list[int], top_k: int) -> "TokenLogprobs":
        """The arrays of proposals that are certain (n-gram drafts): the drafted token is the only candidate, so it
        fills slot 0 and the first top-K slot with logprob 0; the other slots are empty; rank 1."""
        candidates = min(top_k, 1) + 1
        ids = np.full((len(tokens), top_k + 1), NO_TOKEN, dtype=np.int32)
        ids[:, :candidates] = np.asarray(tokens, dtype=np.int32)[:, None]
        logprobs = np.full((len(tokens), top_k + 1), -np.inf, dtype=np.float32)
        logprobs[:, :candidates] = POINT_MASS_LOGPROB
        return cls(ids, logprobs, np.full(len(tokens), POINT_MASS_RANK, dtype=np.int32))

    @classmethod
    def concat(cls, parts: list["TokenLogprobs"]) -> "TokenLogprobs":
        if len(parts) == 1:
            return parts[0]
        return cls(*(np.concatenate([getattr(p, name) for p in parts]) for name in ("token_ids", "logprobs", "ranks")))


@dataclass
class SeqOutput:
    """What one sequence produced in one step."""

    seq: Sequence
    offset: int  # output index of the first emitted token
    tokens: list[int]
    target: TokenLogprobs
    num_accepted: int = 0
    draft_tokens: list[int] = field(default_factory=list)
    draft: TokenLogprobs | None = None  # when the request asked for draft logprobs (or for its speculation stats)
    prompt: TokenLogprobs | None = None  # prompt tokens 1..P-1, in its first prefill only, when the request asked

    @property
    def finish_reason(self) -> FinishReason:
        return self.seq.finish_reason


@dataclass
class EngineStats:
    """Speculation counters in the vocabulary of vLLM's metrics: acceptance length = 1 + accepted / drafts."""

    num_steps: int = 0
    num_emitted_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
