"""The grammar state of every constrained sequence in the engine (llguidance matchers, keyed by sequence).

A matcher consumes exactly the sequence's output tokens, no more: drafts are tried against it and rolled back.
Per step it gives:
- `forced`: the tokens the grammar admits as the only continuation (`{"name": "`, a closing brace), proposed as
  drafts with q = 1 (free drafts: under the masked target they are accepted with probability 1);
- `valid_prefix`: how many of a proposer's drafts the grammar allows, so a forbidden draft and those after it are
  dropped before anything is scored;
- `masks`: the bitmask at each scored row (the last token's and every draft's), computed in one batched call;
- `mask_after`: the bitmask after some tentative tokens, for MTP's drafting steps, so that q is masked too.
A compiled grammar is kept by its hash (shared/structured.py) and each sequence's matcher is a copy of it.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import llguidance
import torch

from shared.structured import StructuredError, check, grammar_of, ll_tokenizer
from services.worker.engine.sequence import Sequence
from services.worker.grammar.token_mask import ALL_ALLOWED, words_for

MAX_COMPILED = 256  # distinct grammars kept compiled; an agent framework sends the same few schemas again and again
LOG_ERRORS_ONLY = 0


def first_line(error: str) -> str:
    """The message of an llguidance error, without the parser state it appends (the whole grammar: megabytes)."""
    return error.split("\n", 1)[0]


class Grammars:
    def __init__(self, model_dir: Path, vocab_size: int, eos_ids: frozenset[int], threads: int = 1) -> None:
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.words = words_for(vocab_size)
        self.tokenizer = ll_tokenizer(Path(model_dir), vocab_size, tuple(sorted(eos_ids)))
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        # By Sequence.key, with the sequence that owns it: a request set back and admitted again (StepGuard) has new
        # sequences under the same keys, and the old ones' release must not take the new ones' matchers.
        self._owned: dict[str, tuple[Sequence, llguidance.LLMatcher]] = {}
        self._executor = llguidance.LLExecutor(num_threads=threads)

    def attach(self, seq: Sequence) -> None:
        """Gives a constrained sequence its matcher, advanced over the output it already has (a resumed or handed-off
        sequence); StructuredError when the grammar does not compile or that output breaks it."""
        structured = seq.sampling.structured
        if structured is None:
            return
        template = self._compiled.get(structured.key)
        if template is None:
            grammar = grammar_of(structured)
            check(grammar, self.tokenizer)
            template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=LOG_ERRORS_ONLY)
            self._compiled[structured.key] = template
            while len(self._compiled) > MAX_COMPILED:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(structured.key)
        matcher = template.deep_copy()
        if seq.output_ids and not matcher.consume_tokens(seq.output_ids):
            raise StructuredError(f"the output so far breaks its grammar: {first_line(matcher.get_error())}")
        self._owned[seq.key] = (seq, matcher)

    @property
    def active(self) -> bool:
        """Whether some sequence has a grammar."""
        return bool(self._owned)

    def has(self, seq: Sequence) -> bool:
        return self._matcher(seq) is not None

    def forget(self, seq: Sequence) -> None:
        owned = self._owned.get(seq.key)
        if owned is not None and owned[0] is seq:
            del self._owned[seq.key]

    def _matcher(self, seq: Sequence) -> llguidance.LLMatcher | None:
        owned = self._owned.get(seq.key)
        return owned[1] if owned is not None and owned[0] is seq else None

    def forced(self, seq: Sequence) -> list[int]:
        """The tokens the grammar forces next (none when it admits a choice)."""
        matcher = self._matcher(seq)
        if matcher.is_stopped():
            return []
        forced = matcher.compute_ff_tokens()
        # The end is not drafted: a complete grammar finishes its sequence without it (constrain.advance).
        ends = [i for i, token in enumerate(forced) if token in self.eos_ids]
        return forced[: ends[0]] if ends else forced

    def valid_prefix(self, seq: Sequence, tokens: list[int]) -> int:
        """How many of `tokens` the grammar accepts in a row from where the sequence stands."""
        return self._matcher(seq).validate_tokens(tokens) if tokens else 0

    def advance(self, seq: Sequence, tokens: list[int]) -> int | None:
        """Consumes emitted tokens up to the one that completes the grammar (after which nothing may follow but the
        end, or the end itself); returns how many it consumed then, or None when the grammar is not complete."""
        matcher = self._matcher(seq)
        for consumed, token in enumerate(tokens, 1):
            if not matcher.consume_token(token):
                raise StructuredError(f"emitted tokens break the grammar: {first_line(matcher.get_error())}")
            if matcher.is_stopped():
                return consumed
        return None

    def masks(self, seqs: list[Sequence], drafts: list[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(bitmask [R, words], rows [R]): for each constrained sequence b, its rows b * width + j for
        j = 0..len(drafts[b]), the mask after its output and its first j drafts (all valid: see valid_prefix)."""
        constrained = [b for b, s in enumerate(seqs) if self._matcher(s) is not None]
        rows = [b * width + j for b in constrained for j in range(len(drafts[b]) + 1)]
        buffer = torch.full((len(seqs) * width, self.words), ALL_ALLOWED, dtype=torch.int32)
        pointer, row_bytes = buffer.data_ptr(), self.words * buffer.element_size()
        plain = [(self._matcher(seqs[b]), b * width) for b in constrained if not drafts[b]]
        drafted = [(self._matcher(seqs[b]), b * width, list(drafts[b])) for b in constrained if drafts[b]]
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, pointer, row_bytes, buffer.shape[0])
        if drafted:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(drafted, pointer, row_bytes, buffer.shape[0])
        index = torch.tensor(rows, dtype=torch.long)
        return buffer[index], index

    def mask_after(self, seqs: list[Sequence], tentative: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(bitmask [R, words], rows [R]) of the constrained ones among `seqs`, each after tentative[b] tokens past
        its output (an MTP draft's earlier drafts); the matchers are rolled back after."""
        rows, masks = [], []
        for b, seq in enumerate(seqs):
            matcher = self._matcher(seq)
            if matcher is None:
                continue
            consumed = matcher.try_consume_tokens(tentative[b]) if tentative[b] else 0
            mask = torch.full((1, self.words), ALL_ALLOWED, dtype=torch.int32)
            if consumed == len(tentative[b]):
                matcher.unsafe_compute_mask_ptr(mask.data_ptr(), self.words * mask.element_size())
            if consumed:
                matcher.rollback(consumed)
            rows.append(b)
            masks.append(mask)
        if not rows:
            return torch.empty(0, self.words, dtype=torch.int32), torch.empty(0, dtype=torch.long)
        return torch.cat(masks), torch.tensor(rows, dtype=torch.long)
