"""Turns one engine step's outputs into its binary frames: PROMPT first (if any), then DRAFT (if any), then TARGET."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from shared.frames import (
    FIRST_SCORED_TOKEN, HEADER, MAX_RECORD_TOKENS, RECORD, WHEREVER, FinishReason, FrameBuilder, FrameKind, SeqStatus,
)
from shared.schemas import WorkRequest
from services.worker.engine.outputs import SeqOutput
from services.worker.engine.sequence import Sequence

# The header step of a frame sent outside the engine's steps: the detokenizer joins DRAFT and TARGET frames by step,
# and the engine numbers its steps from 1.
OUT_OF_STEP = 0
# NATS refuses messages above its max_payload (1 MiB unless configured): a long prompt's scores are split into
# frames of at most half of that.
MAX_PROMPT_FRAME_BYTES = 512 * 1024


def step_frames(
    outputs: list[SeqOutput], worker_id: int, step: int, preempted: Seq[Sequence] = ()
) -> list[bytes]:
    """Frames of one step, in publishing order. PROMPT goes first, so a request's prompt is rendered before its
    first tokens; DRAFT before TARGET, so the detokenizer holds a request's drafts when the TARGET record of the
    same step arrives; it joins them by request id and step.

    A preempted sequence gets a TARGET record with no tokens and status PREEMPTED at the offset where it will
    continue, so the record count stays gapless while it waits to be recomputed."""
    top_k = max((o.target.token_ids.shape[1] - 1 for o in outputs), default=0)
    target = FrameBuilder(FrameKind.TARGET, worker_id, step, top_k)
    draft = None  # built for the first record that has drafts: most steps of most requests have none to report
    for out in outputs:
        seq = out.seq
        if out.draft is not None:
            if draft is None:
                draft = FrameBuilder(FrameKind.DRAFT, worker_id, step, top_k)
            draft.add(
                seq.request_id,
                seq_no=seq.draft_seq_no,
                offset=out.offset,
                token_ids=out.draft.token_ids,
                logprobs=out.draft.logprobs,
                ranks=out.draft.ranks,
                num_accepted=out.num_accepted,
                choice=seq.choice,
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
            choice=seq.choice,
            num_cached=seq.num_cached_tokens if out.offset == 0 else 0,
        )
        seq.target_seq_no += 1
    for seq in preempted:
        target.add_status(
            seq.request_id, seq_no=seq.target_seq_no, offset=len(seq.output_ids), status=SeqStatus.PREEMPTED,
            choice=seq.choice,
        )
        seq.target_seq_no += 1
    return prompt_frames(outputs, worker_id, step) + [b.encode() for b in (draft, target) if b is not None and len(b)]


def prompt_rows_per_frame(top_k: int, max_bytes: int = MAX_PROMPT_FRAME_BYTES) -> int:
    """Prompt tokens one PROMPT frame of this top-K may carry, counting a record per token to be safe."""
    row_bytes = 8 * (top_k + 1) + 4  # ids and logprobs of every slot, and the rank
    return min(MAX_RECORD_TOKENS, (max_bytes - HEADER.itemsize) // (RECORD.itemsize + row_bytes))


def prompt_frames(
    outputs: list[SeqOutput], worker_id: int, step: int, max_bytes: int = MAX_PROMPT_FRAME_BYTES
) -> list[bytes]:
    """The PROMPT frames of one step: each scored prompt's tokens 1..P-1 in records of consecutive tokens, packed
    into frames of at most `max_bytes`. A record's `offset` is the index in the prompt of its first token and its
    `seq_no` counts the request's PROMPT records."""
    scored = [out for out in outputs if out.prompt is not None]
    if not scored:
        return []
    top_k = max(out.prompt.token_ids.shape[1] for out in scored) - 1
    per_frame = prompt_rows_per_frame(top_k, max_bytes)
    frames: list[bytes] = []
    builder, room = FrameBuilder(FrameKind.PROMPT, worker_id, step, top_k), per_frame
    for out in scored:
        prompt, seq_no, start = out.prompt, 0, 0
        while start < len(prompt.ranks):
            if not room:
                frames.append(builder.encode())
                builder, room = FrameBuilder(FrameKind.PROMPT, worker_id, step, top_k), per_frame
            rows = slice(start, start + room)
            builder.add(
                out.seq.request_id, seq_no=seq_no, offset=FIRST_SCORED_TOKEN + start, token_ids=prompt.token_ids[rows],
                logprobs=prompt.logprobs[rows], ranks=prompt.ranks[rows],
            )
            taken = len(prompt.ranks[rows])
            start, seq_no, room = start + taken, seq_no + 1, room - taken
    frames.append(builder.encode())
    return frames


def abort_frame(requests: list[WorkRequest], worker_id: int, step: int) -> bytes:
    """Requests the worker ends without serving them to the end (refused, failing a step, dead-lettered) finish with
    ABORT where their output stands (a resumed one continues its records): the detokenizer ends each with an error."""
    builder = FrameBuilder(FrameKind.TARGET, worker_id, step, top_k=0)
    for request in requests:
        first = request.choices()[0]  # one choice's end fails the whole request at the detokenizer
        builder.add_status(
            request.request_id, seq_no=first.next_seq_no, offset=len(first.output_token_ids),
            status=SeqStatus.FINISHED, finish_reason=FinishReason.ABORT, choice=first.index,
        )
    return builder.encode()


def end_wherever_frame(request_id: str, worker_id: int) -> bytes:
    """A request the worker ends without knowing how far its output got (a dead letter, whose workers died; a message
    it cannot read whole): an ABORT record WHEREVER, which the detokenizer takes wherever the request stands."""
    builder = FrameBuilder(FrameKind.TARGET, worker_id, OUT_OF_STEP, top_k=0)
    builder.add_status(
        request_id, seq_no=WHEREVER, offset=WHEREVER, status=SeqStatus.FINISHED, finish_reason=FinishReason.ABORT
    )
    return builder.encode()
