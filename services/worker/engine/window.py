"""How far back a running sequence's cache is still read under a sliding window (Mistral): the scheduler lets go of
the blocks before that (scheduler.py, `reach`). Plain Python, unit-tested without a model.

A query at position q sees keys q - window < j <= q (model/layers.py), and no later pass of a sequence queries or
writes below where each of its caches stands:
- the trunk's next pass starts at num_computed: its next prompt piece, or its last token and drafts (rows after
  rejected drafts are rewritten from there);
- the MTP module's entries are written, and queried, from where they end, which lags the trunk while a sequence does
  not draft (drafting/mtp.py); its layer has the trunk's window, an EAGLE-3 head's layer its own config's (none);
- a draft model catches up from where its cache ends (at most the last token), with its own window.
The lowest of these, less its window, is the reach. A sequence that has computed nothing since its admission keeps
every block: its drafters may still hold an earlier occupant's state for its slot, and MTP's first piece reads the
trunk state kept beside the block before its start. Where some cache layer attends to every position (a draft model
or an EAGLE-3 head without a window), nothing is out of reach.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from services.worker.engine.sequence import Sequence

if TYPE_CHECKING:
    from services.worker.drafting.draft_model import DraftModelDrafter
    from services.worker.drafting.mtp import MtpDrafter

Reach = Callable[[Sequence], int]


def window_reach(
    window: int | None, mtp: MtpDrafter | None = None, draft: DraftModelDrafter | None = None
) -> Reach | None:
    """The scheduler's `reach` for a model whose layers attend to `window` positions, with these drafters (each
    with its own layer's window); None when some cache layer has no window."""
    if window is None or any(d is not None and d.window is None for d in (mtp, draft)):
        return None

    def reach(seq: Sequence) -> int:
        if seq.num_computed <= seq.prefill_start:
            return 0
        position = seq.num_computed - window + 1
        if mtp is not None:
            # computed_until is one below where its entries end: one position more is kept than needed.
            position = min(position, mtp.computed_until(seq) - mtp.window + 1)
        if draft is not None:
            position = min(position, min(draft.computed_until(seq), seq.num_tokens - 1) - draft.window + 1)
        return position

    return reach
