"""What changes a request's target logits before temperature: logit_bias, vLLM's allowed_token_ids, min_tokens,
vLLM's repetition_penalty and OpenAI's presence and frequency penalties, in that order (vLLM's), on float32 logits:

    logits[t] += logit_bias[t]
    logits[t]  = -inf                         for every token t outside allowed_token_ids
    logits[w]  = -inf                         for the last token w of each bad word whose other tokens end the output
    logits[t]  = -inf                         for every t but the reasoning block's closing tag, once the block holds
                                              thinking_token_budget tokens (whatever the rules above leave)
    logits[s]  = -inf                         for every stop token s while fewer than min_tokens were generated
    logits[t]  = logits[t] / r if logits[t] > 0 else logits[t] * r    for t in the prompt or the output (r: repetition)
    logits[t] -= count[t] * frequency + (count[t] > 0) * presence    (count: t among the generated tokens)

They change the target distribution p itself, so speculation must verify against the penalised p of every drafted
position: the row that scores the token after draft j counts the drafts 0..j-1 as generated, which is exactly the
history that row's token has if those drafts are accepted (and the rows of rejected drafts are never read). The
rules of verification then hold for the penalised p as for the raw one: greedy output is the penalised argmax and
sampled output is distributed as the penalised p, whatever was drafted.

`LogitPenalties.build` gathers the per-row inputs on the host for the rows of requests that ask (None when no row
does, so a batch without penalties pays nothing); `apply_penalties` is one batched tensor op over those rows.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from shared.schemas import NO_PENALTY, NO_REPETITION_PENALTY
from services.worker.engine.sequence import Sequence
from services.worker.sampling.thinking_budget import scan_output

MASKED = float("-inf")  # the logit of a token min_tokens forbids


@dataclass
class LogitPenalties:
    """Per-row inputs for the logits rows of the requests that asked for any penalty, logit_bias or min_tokens:
    R rows, the `width` rows of each of those requests."""

    rows: Tensor  # [R] int64: which rows of the logits these are
    counts: Tensor | None  # [R, V] float32: generated tokens before each row (drafts before it included)
    seen: Tensor | None  # [R, V] bool: tokens of the prompt or before the row (None: no row has a repetition penalty)
    # [R, V] float32: logit_bias, and -inf outside allowed_token_ids and at the stop tokens min_tokens still forbids
    bias: Tensor | None
    presence: Tensor  # [R]
    frequency: Tensor  # [R]
    repetition: Tensor  # [R]

    @classmethod
    def build(
        cls, seqs: Seq[Sequence], drafts: Seq[Seq[int]] | None, width: int, vocab_size: int, device: torch.device
    ) -> LogitPenalties | None:
        """Inputs for logits laid out as `width` consecutive rows per sequence: row j of sequence b scores its
        output position len(output_ids) + j with drafts[b][:j] as generated (rows past a sequence's drafts count
        all of them). None when no sequence asks for anything."""
        asking = [b for b, s in enumerate(seqs) if s.sampling.adjusts_logits]
        if not asking:
            return None
        chosen = [seqs[b] for b in asking]
        drafted = [drafts[b] if drafts else () for b in asking]  # each row j counts the first j as generated
        rows = np.add.outer(np.asarray(asking, dtype=np.int64) * width, np.arange(width)).reshape(-1)
        sampling = [s.sampling for s in chosen]
        per_row = torch.tensor(
            [[p.presence_penalty, p.frequency_penalty, p.repetition_penalty] for p in sampling], dtype=torch.float32
        ).repeat_interleave(width, dim=0).to(device)  # [R, 3]
        wants_counts = any(p.presence_penalty != NO_PENALTY or p.frequency_penalty != NO_PENALTY for p in sampling)
        wants_seen = any(p.repetition_penalty != NO_REPETITION_PENALTY for p in sampling)
        counts = seen = None
        if wants_counts or wants_seen:
            # Each sequence's output once, widened to its rows, plus the drafts before each row.
            counts = _counts([s.output_ids for s in chosen], vocab_size, device).repeat_interleave(width, dim=0)
            prefixes = [tokens[:j] for tokens in drafted for j in range(width)]
            counts.index_put_(*_pairs(prefixes, device), accumulate=True)
        if wants_seen:
            prompt = _counts([s.prompt_ids for s in chosen], vocab_size, device).repeat_interleave(width, dim=0)
            seen = (prompt + counts) > 0
        return cls(
            rows=torch.from_numpy(rows).to(device),
            counts=counts if wants_counts else None,
            seen=seen,
            bias=_bias(chosen, drafted, width, vocab_size, device),
            presence=per_row[:, 0],
            frequency=per_row[:, 1],
            repetition=per_row[:, 2],
        )


def apply_penalties(logits: Tensor, penalties: LogitPenalties | None) -> Tensor:
    """logits [N, V] with the penalties applied to their rows, as a new float32 tensor (the raw logits stay as they
    are: reported logprobs are of the raw model); the same tensor when there are none."""
    if penalties is None:
        return logits
    adjusted = logits.to(torch.float32, copy=True)
    rows = adjusted[penalties.rows]  # [R, V]
    if penalties.bias is not None:
        rows += penalties.bias
    if penalties.seen is not None:
        factor = penalties.repetition.unsqueeze(1)
        rows = torch.where(penalties.seen, torch.where(rows > 0, rows / factor, rows * factor), rows)
    if penalties.counts is not None:
        rows -= penalties.frequency.unsqueeze(1) * penalties.counts
        rows -= penalties.presence.unsqueeze(1) * (penalties.counts > 0)
    adjusted[penalties.rows] = rows
    return adjusted


def _bad_words_due(seq: Sequence, drafted: Seq[int]) -> list[int]:
    """The last tokens of seq's bad words whose other tokens end its output followed by `drafted` (vLLM's rule: the
    prompt does not count, so a word's first tokens must be generated)."""
    due = []
    generated = len(seq.output_ids) + len(drafted)
    for word in seq.sampling.bad_words_token_ids:
        before = len(word) - 1
        if before > generated:
            continue
        tail = _last(seq.output_ids, drafted, before)
        if tail == list(word[:-1]):
            due.append(word[-1])
    return due


def _last(output: list[int], drafted: Seq[int], count: int) -> list[int]:
    """The last `count` tokens of output + drafted, without building the whole list."""
    from_drafts = min(count, len(drafted))
    from_output = count - from_drafts
    return output[len(output) - from_output :] + list(drafted[len(drafted) - from_drafts :])


def _pairs(token_rows: list[Seq[int]], device: torch.device) -> tuple[tuple[Tensor, Tensor], Tensor]:
    """The (row index, token id) pairs of token lists, and a one per pair: index_put_'s arguments."""
    lengths = np.fromiter(map(len, token_rows), dtype=np.int64, count=len(token_rows))
    tokens = np.fromiter(itertools.chain.from_iterable(token_rows), dtype=np.int64, count=int(lengths.sum()))
    index = torch.from_numpy(np.stack([np.repeat(np.arange(len(token_rows)), lengths), tokens])).to(device)  # [2, n]
    return (index[0], index[1]), torch.ones(index.shape[1], dtype=torch.float32, device=device)


def _counts(token_rows: list[Seq[int]], vocab_size: int, device: torch.device) -> Tensor:
    """[len(token_rows), V] float32: how often each token occurs in each list."""
    counts = torch.zeros(len(token_rows), vocab_size, dtype=torch.float32, device=device)
    return counts.index_put_(*_pairs(token_rows, device), accumulate=True)


def _bias(
    seqs: list[Sequence], drafts: list[Seq[int]], width: int, vocab_size: int, device: torch.device,
) -> Tensor | None:
    """[R, V] logit_bias of each row, with -inf outside the request's allowed_token_ids, at the stop tokens of the
    rows whose output position (the sequence's output plus the drafts before the row) is below min_tokens, and at
    the last token of each bad word whose other tokens end that output; None when no row has any. A bad word gives
    way in a row it would leave without a token (the gateway refuses sets that always would); a full thinking
    budget leaves its row the closing tag alone, whatever else masks it."""
    biased: list[tuple[int, int, float]] = []  # (row, token, bias)
    masked: list[tuple[int, int]] = []  # (row, stop token)
    banned: list[tuple[int, int]] = []  # (row, a bad word's last token)
    allowed: list[tuple[int, Tensor]] = []  # (first row of the sequence, its allowed tokens on the device)
    forced: list[tuple[int, int]] = []  # (row, the one token it may have)
    for b, seq in enumerate(seqs):
        budget = seq.sampling.thinking_budget
        if seq.sampling.allowed_token_ids is not None:
            allowed.append((b * width, _allowed_ids(seq, device)))
        if budget is not None:
            seq.thinking_scan = scan_output(budget, seq.output_ids, seq.thinking_scan)
        for j in range(width):
            row, before = b * width + j, drafts[b][:j]  # the drafts this row counts as generated
            biased += [(row, token, value) for token, value in seq.sampling.logit_bias.items()]
            if len(seq.output_ids) + len(before) < seq.sampling.min_tokens:
                masked += [(row, token) for token in seq.stop_ids]
            if seq.sampling.bad_words_token_ids:
                banned += [(row, token) for token in _bad_words_due(seq, before)]
            if budget is not None and (token := seq.thinking_scan.advance(budget, before).forced(budget)) is not None:
                forced.append((row, token))
    if not (biased or masked or banned or allowed or forced):
        return None
    bias = torch.zeros(len(seqs) * width, vocab_size, dtype=torch.float32, device=device)
    # The masks after the biases: a forbidden token stays forbidden whatever its bias (index_put_ gives no order
    # among duplicate indices of one call on CUDA).
    if biased:
        columns = list(zip(*biased))
        index = torch.tensor(columns[:2], dtype=torch.int64).to(device)  # [2, n]
        bias.index_put_((index[0], index[1]), torch.tensor(columns[2], dtype=torch.float32).to(device))
    for first, ids in allowed:
        rows = bias[first : first + width]  # [width, V], a view
        kept = rows[:, ids]  # the allowed tokens' biases
        rows.fill_(MASKED)[:, ids] = kept
    _mask(bias, masked)
    if banned:
        unbanned = bias.clone()
        _mask(bias, banned)
        emptied = ~(bias > MASKED).any(dim=1)  # [R]
        bias = torch.where(emptied[:, None], unbanned, bias)
    if forced:  # last, and whole: a forced row keeps its one token whatever the masks above took
        rows, tokens = (torch.tensor(column, dtype=torch.int64, device=device) for column in zip(*forced))
        bias[rows] = MASKED
        bias[rows, tokens] = 0.0
    return bias


def _mask(bias: Tensor, entries: list[tuple[int, int]]) -> None:
    """-inf at these (row, token) entries."""
    if entries:
        index = torch.tensor(list(zip(*entries)), dtype=torch.int64).to(bias.device)  # [2, n]
        bias.index_put_((index[0], index[1]), torch.tensor(MASKED, device=bias.device))


def _allowed_ids(seq: Sequence, device: torch.device) -> Tensor:
    """The sequence's allowed_token_ids on the device, built at its first step and kept."""
    if seq.allowed_ids is None or seq.allowed_ids.device != device:
        seq.allowed_ids = torch.tensor(seq.sampling.allowed_token_ids, dtype=torch.int64, device=device)
    return seq.allowed_ids
