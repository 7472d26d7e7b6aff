"""Coupled verification on the CPU: drafts checked against the target's own samples, one slot at a time, so that a
sequence draws the noise of exactly the tokens it emits.

Under `target_match`, and under `rejection` for point-mass drafts (ngram, suffix: q(x) = 1), draft j is accepted
iff it equals the target's sample at its position, and the token emitted after the accepted prefix is the target's
sample there (for a point mass the residual max(p - q, 0) is p without x, and removing a loser from the exponential
race does not change its winner). `verify_torch` samples every drafted slot and then the emitted token again; a
sample's noise spans the vocabulary, so on a 2-core CPU that was 2.2 ms of a 4.5 ms step at batch 8 with three
drafts each, most of it for slots after a rejection, which nothing reads. Here slot j is sampled only for the
sequences whose drafts before it were all accepted, and the sample that rejects a draft is the emitted token: a
sequence costs accepted + 1 samples, what plain decoding pays for the same tokens. The tokens are verify_torch's,
bit for bit (tests/test_host_verify.py).
"""

from __future__ import annotations

import torch

from kernels.constants import PAD_TOKEN
from services.worker.sampling.random import Purpose
from services.worker.sampling.rejection import VerifyInput, VerifyOutput, check_verify_args
from services.worker.sampling.sample import sample_torch


def is_coupled(inp: VerifyInput, accept_policy: str, verify_strategy: str) -> bool:
    """Whether verification under these settings is the coupled test this module runs on the CPU."""
    point_mass = verify_strategy == "target_match" or (verify_strategy == "rejection" and inp.draft_probs is None)
    return accept_policy == "normal" and point_mass and inp.target_probs.device.type == "cpu"


def verify_coupled(inp: VerifyInput) -> VerifyOutput | None:
    """verify_torch's result for coupled verification on CPU tensors, sampling slot by slot; None for a drafted
    slot holding no token id (PAD_TOKEN), whose handling is verify_torch's alone (the caller runs it)."""
    check_verify_args(inp, "normal", "target_match")
    batch, num_slots = inp.draft_tokens.shape
    drafts = inp.draft_tokens.tolist()
    num_drafts = inp.num_drafts.tolist()
    if any(token < 0 for row, count in zip(drafts, num_drafts) for token in row[:count]):
        return None
    greedy = inp.greedy.tolist()
    num_accepted, emitted = [0] * batch, [0] * batch
    if any(greedy):
        # Greedy rows: accept while the draft is the argmax, then emit the argmax.
        best = inp.target_probs.argmax(dim=-1).tolist()  # [B, K+1]
        for b in (b for b in range(batch) if greedy[b]):
            j = 0
            while j < num_drafts[b] and drafts[b][j] == best[b][j]:
                j += 1
            num_accepted[b], emitted[b] = j, best[b][j]
    going = [b for b in range(batch) if not greedy[b]]
    for j in range(num_slots + 1):
        if not going:
            break
        rows = torch.tensor(going)
        samples = sample_torch(inp.target_probs[rows, j], inp.seeds[rows], inp.positions[rows] + j, Purpose.SAMPLE)
        still = []
        for b, token in zip(going, samples.tolist()):
            if j < num_drafts[b] and token == drafts[b][j]:
                still.append(b)
            else:
                num_accepted[b], emitted[b] = j, token
        going = still
    output = [
        drafts[b][: num_accepted[b]] + [emitted[b]] + [PAD_TOKEN] * (num_slots - num_accepted[b])
        for b in range(batch)
    ]
    output_tokens = torch.tensor(output, dtype=torch.int64).view(batch, num_slots + 1)
    return VerifyOutput.of(torch.tensor(num_accepted, dtype=torch.int64), output_tokens)
