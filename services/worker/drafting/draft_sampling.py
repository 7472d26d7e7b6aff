"""One drafting step of a model drafter (the MTP module, a draft model): its logits become the draft tokens and
the q they were drawn from, under each request's own sampling.

q is the drafter's distribution under the request's temperature, min-p, top-k and top-p, masked by the request's
grammar when it has one; draft j of a sequence is drawn from it with the noise of (seed, output position of the
draft, DRAFT), so drafts are reproducible whatever the batch; a greedy row takes the argmax (its q is one-hot, so
its reported logprobs are the drafter's own distribution instead). Penalties, logit_bias and min_tokens are left
out of q: verification applies them to the target, which keeps the output exact whatever q is.
"""

from __future__ import annotations

import torch
from torch import Tensor

from services.worker.engine.batch import greedy_mask, sampling_tensors, seeds_positions
from services.worker.engine.sequence import Sequence
from services.worker.grammar.grammars import Grammars
from services.worker.grammar.token_mask import apply_token_mask
from services.worker.sampling.random import Purpose
from services.worker.sampling.sample import process_logits, sample


class DraftSampler:
    """Draws the drafts of `seqs`, step after step; rows name sequences by their index in `seqs`."""

    def __init__(self, seqs: list[Sequence], device: torch.device, grammars: Grammars | None = None) -> None:
        self.seqs = seqs
        self.all_greedy = all(s.sampling.greedy for s in seqs)
        self.any_greedy = any(s.sampling.greedy for s in seqs)
        if not self.all_greedy:  # an all-greedy group takes argmaxes and needs none of them (a few tensors a step)
            self.seeds, self.out_positions = seeds_positions(seqs, device)
            self.temperature, self.top_k, self.top_p, self.min_p = sampling_tensors(seqs, device)
            self.greedy = greedy_mask(seqs, device)
        self.grammars = grammars if grammars is not None and grammars.active else None
        self.drafted: list[list[int]] = [[] for _ in seqs]  # each sequence's drafts so far

    def step(self, logits: Tensor, rows: Tensor, j: int) -> tuple[Tensor, Tensor | None, Tensor]:
        """Draft j of each row from the drafter's logits [A, vocab]: (tokens [A], q [A, vocab], reported logprob
        rows [A, vocab]). q is None when every sequence is greedy: each draft is then the argmax, a point mass,
        and nothing is sampled."""
        if self.grammars is not None:
            logits = self._masked(logits, rows.tolist())
        if self.all_greedy:
            chosen = logits.argmax(dim=-1)
            self._record(rows, chosen)
            return chosen, None, logits
        min_p = None if self.min_p is None else self.min_p[rows]
        q = process_logits(logits, self.temperature[rows], self.top_k[rows], self.top_p[rows], min_p)
        chosen = sample(q, self.seeds[rows], self.out_positions[rows] + j, Purpose.DRAFT)
        report = torch.where(self.greedy[rows, None], logits, q.log()) if self.any_greedy else q.log()
        self._record(rows, chosen)
        return chosen, q, report

    @staticmethod
    def confidence(logits: Tensor, chosen: Tensor) -> list[float]:
        """Each draft's probability under the drafter's own distribution (its logits [A, vocab] at temperature 1,
        before any request's sampling), the EAGLE-2 estimate of how likely the target is to accept it. A function
        of the request's own tokens alone, so a chain cut by it is cut the same in any batch."""
        return logits.softmax(dim=-1).gather(1, chosen[:, None])[:, 0].tolist()

    def _record(self, rows: Tensor, chosen: Tensor) -> None:
        if self.grammars is not None:  # only a grammar reads the drafts so far
            for row, token in zip(rows.tolist(), chosen.tolist()):
                self.drafted[row].append(token)

    def _masked(self, logits: Tensor, rows: list[int]) -> Tensor:
        """logits with what each constrained sequence's grammar forbids after its drafts so far set to -inf."""
        bitmask, masked_rows = self.grammars.mask_after([self.seqs[r] for r in rows], [self.drafted[r] for r in rows])
        if not masked_rows.numel():
            return logits
        return apply_token_mask(logits, bitmask, masked_rows.to(logits.device))


def precision_groups(seqs: list[Sequence], rows: list[int], int8: bool) -> list[tuple[list[int], bool]]:
    """The rows (indices into seqs) a model drafter drafts together, each group with whether its passes read the
    int8 twins (model/int8_linear.py). With twins built, greedy requests draft apart from sampled ones: a greedy
    request's output is the target's argmax whatever it drafts, so it drafts in int8, and by itself, so that what it
    drafts and reports does not depend on the batch; a sampled request's q shapes its seeded sample, so it drafts in
    float. Without twins, one group."""
    if not int8:
        return [(rows, False)] if rows else []
    greedy = [b for b in rows if seqs[b].sampling.greedy]
    sampled = [b for b in rows if not seqs[b].sampling.greedy]
    return [(group, quantized) for group, quantized in ((greedy, True), (sampled, False)) if group]
