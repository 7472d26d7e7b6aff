"""A step's postprocess: the tokens it emits become SeqOutputs.

Kept apart from the engine because it is the one part of a step that runs on the host: after logprobs are computed
(on the device, only for the requests that asked) and the step's results cross in one copy, plain-Python
bookkeeping appends each sequence's accepted drafts plus its recovered or bonus token, rewinds the cache past the
rejected drafts, and assembles the target and draft records the frames carry.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from services.worker.drafting.draft import DraftBatch
from services.worker.engine.host_copy import fetch
from services.worker.engine.outputs import SeqOutput, TokenLogprobs
from services.worker.sampling.logprobs import token_logprobs, with_named_tokens
from services.worker.engine.sequence import Sequence

# Called for every sequence a step drafted for: (sequence, drafts proposed, drafts the verification accepted, those
# of them kept: fewer where a stop condition came first).
DraftObserver = Callable[[Sequence, int, int, int], None]


def accept(
    seqs: list[Sequence],
    target: torch.Tensor,  # [B, W, vocab] logits of each row's candidate tokens
    output_tokens: torch.Tensor,  # [B, W] emitted tokens first, PAD_TOKEN after
    num_accepted: torch.Tensor | None,  # [B] drafts accepted (None: no drafts this step)
    drafts: DraftBatch | None,
    top_k: int,
    max_model_len: int,
    observe: DraftObserver,
) -> list[SeqOutput]:
    """Logprobs for the requests that asked (target and draft, each in one call), one copy to the host, then
    plain-Python bookkeeping: keep the accepted drafts plus the recovered or bonus token (the cache rewinds
    by moving num_computed back)."""
    width = target.shape[1]
    asked = [b for b, s in enumerate(seqs) if s.sampling.logprobs is not None]
    want_drafts = [b for b in asked if seqs[b].sampling.include_draft_logprobs] if drafts is not None else []
    device_arrays = [output_tokens] + ([num_accepted] if num_accepted is not None else [])
    if asked:
        rows = torch.tensor(asked, device=target.device)
        chosen = output_tokens[rows].clamp(min=0).reshape(-1)
        logits = target[rows].reshape(len(asked) * width, -1)
        named = [
            (slice(i * width, (i + 1) * width), seqs[b].sampling.logprob_token_ids)
            for i, b in enumerate(asked)
            if seqs[b].sampling.logprob_token_ids
        ]
        device_arrays += with_named_tokens(logits, token_logprobs(logits, chosen, top_k), named)
    modelled = drafts.modelled_rows(want_drafts) if want_drafts else None
    want_drafts_set = set(want_drafts)
    if modelled is not None:
        device_arrays += token_logprobs(*modelled, top_k)
    host = fetch(device_arrays)
    tokens = host[0]
    accepted = host[1] if num_accepted is not None else np.zeros(len(seqs), dtype=np.int32)
    target_arrays = host[-6:-3] if modelled is not None else host[-3:]
    draft_arrays = host[-3:] if modelled is not None else None
    asked_index = {b: i for i, b in enumerate(asked)}
    next_modelled = 0  # where the next sequence's modelled draft rows start in draft_arrays
    outputs = []
    for b, seq in enumerate(seqs):
        n_accepted = int(accepted[b])
        offset = len(seq.output_ids)
        if drafts is not None:
            seq.num_computed = seq.num_tokens + n_accepted
        kept = seq.append(tokens[b, : n_accepted + 1].tolist(), max_model_len)
        if b in asked_index:
            first = asked_index[b] * width
            target_lp = TokenLogprobs(*(a[first : first + len(kept)] for a in target_arrays))
        else:
            target_lp = TokenLogprobs.tokens_only(kept, top_k)
        out = SeqOutput(seq, offset, kept, target_lp, num_accepted=min(n_accepted, len(kept)))
        if drafts is not None:
            draft = drafts.drafts[b]
            out.draft_tokens = draft.tokens
            if draft.tokens and b in want_drafts_set:
                parts = []
                if draft.num_modelled:
                    end = next_modelled + draft.num_modelled
                    parts.append(TokenLogprobs(*(a[next_modelled:end] for a in draft_arrays)))
                    next_modelled = end
                if len(draft.tokens) > draft.num_modelled:
                    parts.append(TokenLogprobs.point_masses(draft.tokens[draft.num_modelled :], top_k))
                out.draft = TokenLogprobs.concat(parts)
            elif draft.tokens and seq.sampling.speculative.return_stats:
                # The DRAFT record the detokenizer counts for usage.speculative: the tokens, nothing computed.
                out.draft = TokenLogprobs.tokens_only(draft.tokens, top_k)
            observe(seq, len(draft.tokens), n_accepted, out.num_accepted)
        outputs.append(out)
    return outputs
