"""The engine's steps under a grammar: which drafts are scored, what verification and sampling read, when the output
is complete. Called only for batches holding a constrained sequence (see grammars.py for the state).

Exact under every method: the target a row is verified or sampled against is the grammar-masked one (after its
output and the drafts before it, as penalties count them), so what is emitted is what step-by-step masked decoding
emits, greedy or seeded; drafts only decide how many tokens a step emits. A draft the grammar forbids, and every
draft after it, is dropped before the pass. Where the grammar forces the next tokens, they replace the method's
drafts as point masses: the masked target gives each probability 1, so all are accepted.
"""

from __future__ import annotations

import logging

import torch

from shared.frames import FinishReason
from shared.structured import StructuredError
from services.worker.drafting.draft import Draft
from services.worker.engine.outputs import SeqOutput
from services.worker.engine.sequence import Sequence, SeqState
from services.worker.grammar.grammars import Grammars
from services.worker.grammar.token_mask import apply_token_mask

log = logging.getLogger("specmesh.worker")

# Forced tokens proposed in one step; the engine reserves cache room for this many drafts whatever its method.
MAX_FORCED_DRAFTS = 8


def constrain_drafts(
    grammars: Grammars, seqs: list[Sequence], drafts: list[Draft], max_model_len: int, max_forced: int
) -> list[Draft]:
    """Each constrained sequence's drafts: the tokens its grammar forces if any (at most `max_forced`, the drafts the
    cache has room for), else the method's drafts cut at the first the grammar forbids."""
    constrained = []
    for seq, draft in zip(seqs, drafts):
        if not grammars.has(seq):
            constrained.append(draft)
            continue
        room = min(max_forced, seq.max_new_tokens(max_model_len) - 1)
        forced = grammars.forced(seq)[: max(room, 0)]
        if forced:
            constrained.append(Draft(forced))
            continue
        keep = grammars.valid_prefix(seq, draft.tokens)
        if keep == len(draft.tokens):
            constrained.append(draft)
            continue
        probs = None if draft.probs is None else draft.probs[:keep]
        report = None if draft.report_logits is None else draft.report_logits[: min(keep, draft.num_modelled)]
        constrained.append(Draft(draft.tokens[:keep], probs, report if keep and report is not None else None))
    return constrained


RowMasks = tuple[torch.Tensor, torch.Tensor]  # (bitmask [R, words], rows [R]), from Grammars.masks


def apply_masks(scores: torch.Tensor, masks: RowMasks) -> torch.Tensor:
    """scores [B * width, vocab] (`width` rows per sequence: its last token's, then one per draft) with the tokens
    each constrained sequence's grammar forbids at each row set to -inf. The masks need only the drafts, so the engine
    computes them on the host while the device runs the step's pass, and applies them here in one go."""
    bitmask, rows = masks
    if not rows.numel():
        return scores
    return apply_token_mask(scores, bitmask, rows.to(scores.device))


def advance(grammars: Grammars, outputs: list[SeqOutput]) -> None:
    """Feeds each constrained sequence's emitted tokens to its grammar; one whose grammar is complete finishes there
    (COMPLETE: "stop" to the client, its last token rendered), as at a stop token: nothing but the end may follow.
    What a step emitted after the grammar's last token (the end, or whatever a bonus row the grammar left nothing to
    gave, when min_tokens forbade the end) is not emitted: step-by-step decoding finishes before scoring that row, so
    the output does not depend on whether the grammar's last token came as a draft or as the step's last token.
    One whose grammar cannot go on finishes CONSTRAINT_FAILED: the client gets a 400 naming its constraint."""
    for out in outputs:
        seq = out.seq
        if not out.tokens or not grammars.has(seq):
            continue
        try:
            complete = grammars.advance(seq, out.tokens)
        except StructuredError as exc:
            # A token the mask allowed that the matcher cannot take: one of the grammar engine's limits, reached
            # by this constraint at this point of its output. The request's own, ended alone: it fails the step
            # for nobody else.
            log.warning("request %s: its constraint fails at run time: %s", seq.request_id, exc)
            seq.state = SeqState.FINISHED
            seq.finish_reason = FinishReason.CONSTRAINT_FAILED
            continue
        if complete is None:
            continue
        if complete < len(out.tokens):
            del seq.output_ids[len(seq.output_ids) - len(out.tokens) + complete :]
            out.tokens = out.tokens[:complete]
            out.target = out.target.head(complete)
            out.num_accepted = min(out.num_accepted, complete)
        elif seq.is_finished:
            continue  # ended at the grammar's last token by a stop token (the end itself: STOP) or the length
        seq.state = SeqState.FINISHED
        seq.finish_reason = FinishReason.COMPLETE
