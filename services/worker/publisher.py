"""Turns one engine step's outputs into its binary frames: DRAFT first (if any), then TARGET."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from shared.frames import FrameBuilder, FrameKind, SeqStatus
from services.worker.engine import SeqOutput
from services.worker.sequence import Sequence


def step_frames(
    outputs: list[SeqOutput], worker_id: int, step: int, preempted: Seq[Sequence] = ()
) -> list[bytes]:
    """Frames of one step, in publishing order. DRAFT goes first so the detokenizer holds a request's drafts
    when the TARGET record of the same step arrives; it joins them by request id and step.

    A preempted sequence gets a TARGET record with no tokens and status PREEMPTED at the offset where it will
    continue, so the record count stays gapless while it waits to be recomputed."""
    top_k = max((o.target.token_ids.shape[1] - 1 for o in outputs), default=0)
    target = FrameBuilder(FrameKind.TARGET, worker_id, step, top_k)
    draft = FrameBuilder(FrameKind.DRAFT, worker_id, step, top_k)
    for out in outputs:
        seq = out.seq
        if out.draft is not None:
            draft.add(
                seq.request_id,
                seq_no=seq.draft_seq_no,
                offset=out.offset,
                token_ids=out.draft.token_ids,
                logprobs=out.draft.logprobs,
                ranks=out.draft.ranks,
                num_accepted=out.num_accepted,
            )
            seq.draft_seq_no += 1
        target.add(
            seq.request_id,
            seq_no=seq.target_seq_no,
            offset=out.offset,
            token_ids=out.target.token_ids,
            logprobs=out.target.logprobs,
            ranks=out.target.ranks,
            num_accepted=out.num_accepted,
            status=SeqStatus.FINISHED if seq.is_finished else SeqStatus.RUNNING,
            finish_reason=seq.finish_reason,
        )
        seq.target_seq_no += 1
    for seq in preempted:
        target.add_status(
            seq.request_id, seq_no=seq.target_seq_no, offset=len(seq.output_ids), status=SeqStatus.PREEMPTED
        )
        seq.target_seq_no += 1
    return [b.encode() for b in (draft, target) if len(b)]
