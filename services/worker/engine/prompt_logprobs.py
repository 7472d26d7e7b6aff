"""Prompt logprobs, for the requests that ask (completions `echo` with `logprobs`, vLLM's `prompt_logprobs`): the
target's log-softmax at prompt positions 0..P-2 evaluated at prompt tokens 1..P-1, with the top-k at each position.

They come from the prefill passes, whose hidden states hold a row for every prompt token; only the asking
requests' rows go through the LM head, a slice of PROMPT_LOGITS_ROWS rows at a time, so that a long prompt never
holds its whole [P, vocab] logits at once. A request's prompt is scored once, by its first choice in that choice's
first prefill (piece by piece when the prefill is chunked; the engine sends the pieces with the first token): the
other choices share the prompt (and may skip the part of it their leader computes, scheduler.py), and a choice
that resumes (preempted, or handed over by another worker) already has output, so the prompt went out before. The
first choice is first in the queue and never starts from cached blocks, so its first prefill computes the whole
prompt.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np
import torch

from shared.frames import FIRST_SCORED_TOKEN
from services.worker.engine.host_copy import fetch
from services.worker.engine.outputs import TokenLogprobs
from services.worker.engine.runner import ModelRunner
from services.worker.sampling.logprobs import token_logprobs
from services.worker.engine.sequence import Sequence

PROMPT_LOGITS_ROWS = 512  # rows of prompt logits [rows, vocab] alive at once


def score_prompts(
    runner: ModelRunner,
    seqs: Seq[Sequence],  # the scoring choices of requests that asked for prompt scores
    hidden: torch.Tensor,  # [T, hidden] of the prefill pass
    first_rows: np.ndarray,  # [len(seqs)] the row of each sequence's first token of this pass in `hidden`
    starts: Seq[int],  # the position of that token
    lengths: Seq[int],  # the tokens of each sequence in this pass
) -> list[TokenLogprobs]:
    """Per sequence, the frame arrays of the prompt tokens this pass scores (slot 0 the prompt token, then the top-k
    of the position before it; width the largest k asked): row j of a piece, at position start + j, scores the
    prompt token after it, up to the prompt's last. A piece may score none (a prompt of one token, or a last piece
    of one row)."""
    top_k = max(s.sampling.prompt_logprobs for s in seqs)
    counts = [max(0, min(n, len(s.prompt_ids) - 1 - start)) for s, start, n in zip(seqs, starts, lengths)]
    rows = np.concatenate([np.arange(first, first + n) for first, n in zip(first_rows, counts)])
    targets = np.concatenate([
        np.asarray(s.prompt_ids[start + FIRST_SCORED_TOKEN : start + FIRST_SCORED_TOKEN + n], dtype=np.int64)
        for s, start, n in zip(seqs, starts, counts)
    ])
    device = hidden.device
    parts = []
    for start in range(0, len(rows), PROMPT_LOGITS_ROWS):
        piece = slice(start, start + PROMPT_LOGITS_ROWS)
        logits = runner.logits(hidden[torch.from_numpy(rows[piece]).to(device)])  # [rows, vocab]
        parts.append(token_logprobs(logits, torch.from_numpy(targets[piece]).to(device), top_k))
    if not parts:
        return [TokenLogprobs.tokens_only([], top_k) for _ in seqs]
    # The prefill's own results follow in the step's usual copy; prompt scores are rare enough to take their own.
    ids, logprobs, ranks = fetch([torch.cat(arrays) for arrays in zip(*parts)])
    scores, start = [], 0
    for n in counts:
        scores.append(TokenLogprobs(ids[start : start + n], logprobs[start : start + n], ranks[start : start + n]))
        start += n
    return scores


class PromptScores:
    """The scores of prompts prefilled in pieces, kept by sequence until its first token goes out with them."""

    def __init__(self) -> None:
        self._parts: dict[str, list[TokenLogprobs]] = {}  # by sequence key

    def gather(
        self, runner: ModelRunner, seqs: Seq[Sequence], hidden: torch.Tensor, first_rows: np.ndarray,
        starts: Seq[int], lengths: Seq[int],
    ) -> None:
        """Scores these sequences' pieces of one pass (score_prompts) and keeps them after their earlier ones."""
        for seq, start, part in zip(seqs, starts, score_prompts(runner, seqs, hidden, first_rows, starts, lengths)):
            if start == 0:
                self._parts[seq.key] = []
            elif seq.key not in self._parts:
                raise ValueError(f"request {seq.request_id} skipped part of the prompt its first choice must score")
            self._parts[seq.key].append(part)

    def take(self, seq: Sequence) -> TokenLogprobs | None:
        """The sequence's whole prompt scores, if it gathered any; forgotten here."""
        parts = self._parts.pop(seq.key, None)
        return None if parts is None else TokenLogprobs.concat(parts)

    def forget(self, seq: Sequence) -> None:
        self._parts.pop(seq.key, None)
