"""A request as the worker's bookkeeping sees it: tokens, slot, counters. Plain Python; the one tensor is a device
copy of its allowed tokens, kept for the sampler."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shared.frames import FinishReason
from shared.prefix_hash import BlockHash, extend_hashes
from shared.schemas import SamplingParams
from services.worker.engine.timeline import Timeline

if TYPE_CHECKING:
    from services.worker.engine.handoff import ImportedChoice
    from torch import Tensor

    from services.worker.sampling.thinking_budget import Scan

SCORING_CHOICE = 0  # the choice whose first prefill scores the request's prompt (engine/prompt_logprobs.py)


class SeqState(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()
    HANDED_OFF = enum.auto()  # exported to a decode worker after its prefill (engine/handoff.py)


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    seed: int  # this choice's seed, from the request's seed or a fresh one drawn for it (shared/seeds.py)
    stop_ids: frozenset[int]
    output_ids: list[int] = field(default_factory=list)
    choice: int = 0  # which of the request's n choices: they share request_id, prompt and sampling
    state: SeqState = SeqState.WAITING
    slot: int | None = None
    num_computed: int = 0  # tokens whose keys and values are in the cache
    finish_reason: FinishReason = FinishReason.NONE
    target_seq_no: int = 0  # TARGET records sent so far
    draft_seq_no: int = 0  # DRAFT records sent so far
    num_drafts: int = 0  # speculation statistics for this request
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Prefix caching (engine/prefix_cache.py): the root of its blocks' names, None when its blocks are not cached
    cache_root: BlockHash | None = None
    block_names: list[BlockHash] = field(default_factory=list)  # of its first full blocks, extended as needed
    num_published: int = 0  # leading blocks named in the prefix cache
    num_cached_tokens: int = 0  # prompt tokens its first prefill found cached (usage's cached_tokens)
    # Chunked prefill: where its prefill started (past a cached or shared prefix), and the choice of its request
    # whose prefill computes the blocks it shares (scheduler.py), until those are computed
    prefill_start: int = 0
    admission: int = 0  # times the scheduler admitted it (a preempted sequence comes back as a new admission)
    leader: Sequence | None = field(default=None, repr=False, compare=False)
    # Prefill/decode disaggregation: the state a prefill worker handed over (engine/handoff.py), until admitted
    imported: ImportedChoice | None = field(default=None, repr=False, compare=False)
    # Where its reasoning block stood after its output's first tokens, for a thinking budget
    # (sampling/thinking_budget.py), kept so that a step scans only its new tokens
    thinking_scan: Scan | None = field(default=None, repr=False, compare=False)
    # Its allowed_token_ids as the sampler's device holds them (sampling/penalties.py), built once
    allowed_ids: Tensor | None = field(default=None, repr=False, compare=False)
    timeline: Timeline = field(default_factory=Timeline, repr=False, compare=False)  # its phases, for the metrics

    @property
    def key(self) -> str:
        """Names this choice wherever state is kept per sequence: the request id, with `/choice` after it for all
        choices but the first."""
        return self.request_id if self.choice == 0 else f"{self.request_id}/{self.choice}"

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prefill_target(self) -> int:
        """Positions its prefill computes: the whole prompt (a fresh sequence samples from the last one's logits), or
        every token but its last (a resumed one decodes from there)."""
        return len(self.prompt_ids) if not self.output_ids else self.num_tokens - 1

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < self.prefill_target

    @property
    def scores_prompt(self) -> bool:
        """Whether its next prefill scores the prompt (prompt logprobs, echo): the scoring choice's first one."""
        return self.sampling.prompt_logprobs is not None and self.choice == SCORING_CHOICE and not self.output_ids

    def names(self, num_blocks: int, block_size: int) -> list[BlockHash]:
        """The names of its first `num_blocks` blocks (full blocks of its tokens)."""
        if len(self.block_names) < num_blocks:
            extend_hashes(self.block_names, self.cache_root, self.token_ids[: num_blocks * block_size], block_size)
        return self.block_names[:num_blocks]

    @property
    def is_finished(self) -> bool:
        return self.state is SeqState.FINISHED

    def max_new_tokens(self, max_model_len: int) -> int:
        """How many more tokens this sequence may emit before max_tokens or the context length ends it."""
        return min(self.sampling.max_tokens - len(self.output_ids), max_model_len - self.num_tokens)

    def append(self, tokens: list[int], max_model_len: int) -> list[int]:
        """Appends emitted tokens up to the first stop condition; returns the tokens kept."""
        kept: list[int] = []
        if self.timeline.first_token is None and tokens:  # the check alone on every later step
            self.timeline.on_token()
        for token in tokens:
            kept.append(token)
            self.output_ids.append(token)
            if token in self.stop_ids:
                self.finish_reason = FinishReason.STOP
                break
            if self.max_new_tokens(max_model_len) <= 0:
                self.finish_reason = FinishReason.LENGTH
                break
        if self.finish_reason is not FinishReason.NONE:
            self.state = SeqState.FINISHED
        return kept
