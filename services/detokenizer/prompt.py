"""A request's prompt at the detokenizer: completions' `echo` (the prompt's text first, with its tokens' logprobs
entries when `logprobs` is set) and vLLM's `prompt_logprobs`, from the prompt's token ids (DetokOpen) and the
PROMPT records a worker sends after scoring the prompt in its prefill (docs/frames.md).

Prompt token 0 has no logprob, since nothing comes before it: its echo entry has a null logprob and null
top_logprobs, and its prompt_logprobs entry is null. The prompt goes out in parts of at most
PROMPT_TOKENS_PER_PART tokens as its records arrive, so that no chunk outgrows a NATS message, and all of it goes
out before the first generated token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from services.detokenizer import logprobs
from services.detokenizer.incremental import IncrementalDecoder, TokenTable
from shared.frames import FIRST_SCORED_TOKEN, NO_TOKEN
from shared.schemas import DetokOpen

if TYPE_CHECKING:  # the assembler holds a PromptAssembler: a runtime import would be circular
    from services.detokenizer.assembler import Record

# With 20 alternatives in both spellings a prompt token takes up to ~2.5 KB of JSON: a part stays far below 1 MiB.
PROMPT_TOKENS_PER_PART = 128

PromptLogprob = dict[str, dict] | None  # vLLM's entry: token id -> {"logprob", "rank", "decoded_token"}


@dataclass(frozen=True)
class PromptPart:
    """Consecutive prompt tokens as one chunk shows them."""

    text: str  # their text when echoed, else ""
    entries: list[logprobs.Entry]  # their echo logprobs entries (none unless echo with logprobs)
    prompt_logprobs: list[PromptLogprob] | None  # vLLM's prompt_logprobs entries; None when not asked


def wants_prompt(open_msg: DetokOpen) -> bool:
    return open_msg.echo or open_msg.prompt_logprobs is not None


class PromptAssembler:
    """Collects a request's PROMPT records in order and cuts what has arrived into parts."""

    def __init__(self, open_msg: DetokOpen, table: TokenTable) -> None:
        self._table = table
        self._ids = open_msg.prompt_token_ids
        self._echo = open_msg.echo
        self._echo_k = open_msg.logprobs if open_msg.echo else None
        self._shown_k = open_msg.prompt_logprobs
        asked = [k for k in (self._echo_k, self._shown_k) if k is not None]
        # Tokens whose scores are here: token 0 needs none, and without scores the ids are all there is.
        self._ready = FIRST_SCORED_TOKEN if asked else len(self._ids)
        self._sent = 0
        shown = table.special_names if open_msg.echo_special_tokens else ()
        self._decoder = IncrementalDecoder(table, shown, starts_text=True)
        num_scored = max(len(self._ids) - FIRST_SCORED_TOKEN, 0)
        num_slots = max(asked, default=0) + 1
        # Row i holds prompt token i + 1 (slot 0) and the top-k at the position before it, as the frames do.
        self._top_ids = np.full((num_scored, num_slots), NO_TOKEN, dtype=np.int32)
        self._top_logprobs = np.full((num_scored, num_slots), -math.inf, dtype=np.float32)
        self._ranks = np.zeros(num_scored, dtype=np.int32)

    @property
    def done(self) -> bool:
        """Whether every part has been taken: generated tokens may follow."""
        return self._sent == len(self._ids)

    @property
    def missing(self) -> str:
        return f"lost frames: the prompt's tokens from {self._ready} on never arrived (PROMPT records)"

    def add(self, record: Record) -> str | None:
        """Takes a PROMPT record's tokens past those already here (a worker that redoes the prefill sends them
        again); returns the problem when the record does not continue the prompt."""
        end = record.offset + record.num_tokens
        if record.offset < FIRST_SCORED_TOKEN or end > len(self._ids):
            return f"PROMPT record for tokens {record.offset}..{end - 1} of a {len(self._ids)}-token prompt"
        if end <= self._ready:
            return None
        if record.offset > self._ready:
            return self.missing
        skip = self._ready - record.offset
        if record.ids[skip:] != list(self._ids[self._ready : end]):
            return f"PROMPT record seq_no {record.seq_no} holds tokens other than the prompt's"
        num_slots = min(self._top_ids.shape[1], record.token_ids.shape[1])
        top_ids = record.token_ids[skip:, :num_slots]
        vocab = self._table.vocab_size
        if ((top_ids != NO_TOKEN) & ((top_ids < 0) | (top_ids >= vocab))).any():
            return f"token id outside the vocabulary of {vocab} in PROMPT record seq_no {record.seq_no}"
        rows = slice(self._ready - FIRST_SCORED_TOKEN, end - FIRST_SCORED_TOKEN)
        self._top_ids[rows, :num_slots] = top_ids
        self._top_logprobs[rows, :num_slots] = record.logprobs[skip:, :num_slots]
        self._ranks[rows] = record.ranks[skip:]
        self._ready = end
        return None

    def take(self) -> list[PromptPart]:
        """The parts ready to go: whole parts as tokens arrive, the rest once the whole prompt is here."""
        parts = []
        complete = self._ready == len(self._ids)
        while self._sent < self._ready and (complete or self._ready - self._sent >= PROMPT_TOKENS_PER_PART):
            end = min(self._sent + PROMPT_TOKENS_PER_PART, self._ready)
            parts.append(self._part(self._sent, end))
            self._sent = end
        return parts

    def _part(self, start: int, end: int) -> PromptPart:
        text, spans = "", [(0, 0)] * (end - start)
        if self._echo:
            step = self._decoder.step(self._ids[start:end], final=end == len(self._ids))
            text, spans = step.text, step.spans
        first = max(start, FIRST_SCORED_TOKEN)  # tokens first..end-1 have scores
        rows = slice(first - FIRST_SCORED_TOKEN, end - FIRST_SCORED_TOKEN)
        entries: list[logprobs.Entry] = []
        if self._echo_k is not None:
            if start == 0:
                entries.append(logprobs.Entry(self._ids[0], None, None, spans[0][0]))
            offsets = [s for s, _ in spans[first - start :]]
            entries += logprobs.entries(self._top_ids[rows], self._top_logprobs[rows], self._echo_k, offsets)
        shown = None
        if self._shown_k is not None:
            shown = [None] if start == 0 else []
            shown += [self._prompt_logprob(row) for row in range(rows.start, rows.stop)]
        return PromptPart(text, entries, shown)

    def _prompt_logprob(self, row: int) -> PromptLogprob:
        """vLLM's entry: the prompt token with its rank, then the top-k with ranks 1..k (a token listed once)."""
        k = self._shown_k
        entry: dict[str, dict] = {}
        ids = self._top_ids[row, : k + 1].tolist()
        lps = self._top_logprobs[row, : k + 1].tolist()
        for slot, (token, logprob) in enumerate(zip(ids, lps)):
            if token == NO_TOKEN or str(token) in entry:
                continue
            entry[str(token)] = {
                "logprob": max(logprob, logprobs.MIN_LOGPROB),
                "rank": int(self._ranks[row]) if slot == 0 else slot,
                "decoded_token": self._table.display(token)[0],
            }
        return entry
