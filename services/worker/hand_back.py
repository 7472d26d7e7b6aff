"""What a draining worker puts back on the work queue for a request it has not finished (QueueWorker.hand_back).

The request goes back with each unfinished choice's progress, the tokens its client has already been sent and the
number of its next TARGET record, and with the seed this worker drew, so the worker that takes it continues the
same output rather than starting over. The engine process reads the progress off its scheduler when it stops
(`unfinished`); the event loop, which holds the original requests, builds what goes back (`resumed_request`).
"""

from __future__ import annotations

from collections import defaultdict

from shared.schemas import ChoiceProgress, WorkRequest
from services.worker.engine_protocol import Unfinished
from services.worker.engine.scheduler import Scheduler
from services.worker.engine.sequence import Sequence


def unfinished(scheduler: Scheduler) -> dict[str, Unfinished]:
    """The progress of the unfinished sequences in the scheduler, running or waiting, by request id."""
    pending: dict[str, list[Sequence]] = defaultdict(list)
    for seq in scheduler.running + list(scheduler.waiting):
        if not seq.is_finished:
            pending[seq.request_id].append(seq)
    return {request_id: _progress(sorted(seqs, key=lambda s: s.choice)) for request_id, seqs in pending.items()}


def _progress(seqs: list[Sequence]) -> Unfinished:
    """One request's unfinished choices, by choice index; the sampling is its first choice's (with the seed drawn)."""
    return Unfinished(
        progress=tuple(
            ChoiceProgress(index=s.choice, output_token_ids=tuple(s.output_ids), next_seq_no=s.target_seq_no)
            for s in seqs
        ),
        sampling=seqs[0].sampling,
    )


def resumed_request(original: WorkRequest, progress: Unfinished | None) -> WorkRequest:
    """The request as it is handed back: the original with its unfinished choices' progress, or the original
    unchanged when none of its choices has started."""
    if progress is None:
        return original
    return original.model_copy(update={"progress": progress.progress, "sampling": progress.sampling})
