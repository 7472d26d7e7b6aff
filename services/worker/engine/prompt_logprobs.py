"""Prompt logprobs, for the requests that ask (completions `echo` with `logprobs`, vLLM's `prompt_logprobs`): the
target's log-softmax at prompt positions 0..P-2 evaluated at prompt tokens 1..P-1, with the top-k at each position.

They come from the prefill pass, whose hidden states hold a row for every prompt token; only the asking requests'
rows go through the LM head, a slice of PROMPT_LOGITS_ROWS rows at a time, so that a long prompt never holds its
whole [P, vocab] logits at once. A request's prompt is scored once, by its first choice in that choice's first
prefill: the other choices share the prompt (and may skip the part of it their leader computes, scheduler.py), and
a choice that resumes (preempted, or handed over by another worker) already has output, so the prompt went out
before. The first choice is first in the queue, so its first prefill always computes the whole prompt.
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
from services.worker.engine.sequence import SCORING_CHOICE, Sequence

PROMPT_LOGITS_ROWS = 512  # rows of prompt logits [rows, vocab] alive at once


def score_prompts(
    runner: ModelRunner,
    seqs: Seq[Sequence],
    hidden: torch.Tensor,  # [T, hidden] of the prefill pass
    first_rows: np.ndarray,  # [len(seqs)] the row of each sequence's first token of this pass in `hidden`
    starts: Seq[int],  # the position of that token
) -> list[TokenLogprobs | None]:
    """Per sequence in its first prefill, the frame arrays of its prompt tokens 1..P-1 (slot 0 the prompt token, then
    the top-k of the position before it; width the largest k asked), or None when it does not score the prompt."""
    askers = [
        b for b, s in enumerate(seqs)
        if s.sampling.prompt_logprobs is not None and s.choice == SCORING_CHOICE
        and len(s.prompt_ids) > FIRST_SCORED_TOKEN
    ]
    if skipped := [seqs[b].request_id for b in askers if starts[b] != 0]:
        raise ValueError(f"requests {skipped} skipped part of the prompt their first choice must score")
    scores: list[TokenLogprobs | None] = [None] * len(seqs)
    if not askers:
        return scores
    top_k = max(seqs[b].sampling.prompt_logprobs for b in askers)
    counts = [len(seqs[b].prompt_ids) - FIRST_SCORED_TOKEN for b in askers]
    rows = np.concatenate([np.arange(first_rows[b], first_rows[b] + n) for b, n in zip(askers, counts)])
    targets = np.concatenate([np.asarray(seqs[b].prompt_ids[FIRST_SCORED_TOKEN:], dtype=np.int64) for b in askers])
    device = hidden.device
    parts = []
    for start in range(0, len(rows), PROMPT_LOGITS_ROWS):
        piece = slice(start, start + PROMPT_LOGITS_ROWS)
        logits = runner.logits(hidden[torch.from_numpy(rows[piece]).to(device)])  # [rows, vocab]
        parts.append(token_logprobs(logits, torch.from_numpy(targets[piece]).to(device), top_k))
    # The prefill's own results follow in the step's usual copy; prompt scores are rare enough to take their own.
    ids, logprobs, ranks = fetch([torch.cat(arrays) for arrays in zip(*parts)])
    start = 0
    for b, n in zip(askers, counts):
        scores[b] = TokenLogprobs(ids[start : start + n], logprobs[start : start + n], ranks[start : start + n])
        start += n
    return scores
