"""How a step picks the tokens it emits from its scored (and penalised) logits.

Without drafts every row emits one token, the argmax or a seeded sample; with drafts the configured verification
rule decides how many drafts each sequence keeps. Kept apart from the engine because both draw their noise only from
the sequence's seed and output position (sampling/random.py), which is what makes seeded output independent of
batch, method and worker: the rules live here, the engine only calls them.
"""

from __future__ import annotations

import torch

from services.worker.engine.batch import greedy_mask, sampling_tensors, seeds_positions
from services.worker.drafting.draft import DraftBatch
from services.worker.sampling.greedy import greedy_verify
from services.worker.sampling.rejection import AcceptPolicy, VerifyInput, VerifyStrategy, verify
from services.worker.sampling.sample import process_logits, sample
from services.worker.engine.sequence import Sequence


def sample_tokens(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """One token per row of logits [N, vocab]: the argmax for greedy rows, a seeded sample for the others
    (the noise plain decoding draws at the sequence's next output position)."""
    chosen = logits.argmax(dim=-1)
    sampled = [b for b, s in enumerate(seqs) if not s.sampling.greedy]
    if sampled:
        rows = torch.tensor(sampled, device=logits.device)
        subset = [seqs[b] for b in sampled]
        probs = process_logits(logits[rows], *sampling_tensors(subset, logits.device))
        chosen[rows] = sample(probs, *seeds_positions(subset, logits.device))
    return chosen


def verify_drafts(
    target: torch.Tensor, drafts: DraftBatch, seqs: list[Sequence], accept_policy: AcceptPolicy,
    verify_strategy: VerifyStrategy,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output_tokens [B, K+1], num_accepted [B]) under the configured strategy; an all-greedy batch takes
    the greedy rule directly, drawing no noise (the debugging accept policies go through verify)."""
    if accept_policy == "normal" and all(s.sampling.greedy for s in seqs):
        return greedy_verify(target, drafts.tokens, drafts.counts)
    batch, rows, vocab = target.shape
    params = sampling_tensors(seqs, target.device, rows)
    probs = process_logits(target.reshape(-1, vocab), *params).view(batch, rows, vocab)
    seeds, positions = seeds_positions(seqs, target.device)
    result = verify(
        VerifyInput(
            target_probs=probs, draft_tokens=drafts.tokens, num_drafts=drafts.counts, draft_probs=drafts.q,
            greedy=greedy_mask(seqs, target.device), seeds=seeds, positions=positions, top_p=params[2][::rows],
        ),
        accept_policy,
        verify_strategy,
    )
    return result.output_tokens, result.num_accepted
