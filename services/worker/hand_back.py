"""What a draining worker puts back on the work queue for a request it has not finished (QueueWorker.hand_back).

The request goes back with each unfinished choice's progress, the tokens its client has already been sent and the
number of its next TARGET record, and with the seed this worker drew, so the worker that takes it continues the
same output rather than starting over.
"""

from __future__ import annotations

from collections import defaultdict

from shared.schemas import ChoiceProgress, WorkRequest
from services.worker.scheduler import Scheduler
from services.worker.sequence import Sequence


def unfinished_choices(scheduler: Scheduler) -> dict[str, list[Sequence]]:
    """The unfinished sequences in the scheduler, running or waiting, by request id."""
    pending: dict[str, list[Sequence]] = defaultdict(list)
    for seq in scheduler.running + list(scheduler.waiting):
        if not seq.is_finished:
            pending[seq.request_id].append(seq)
    return pending


def resumed_request(original: WorkRequest, unfinished: list[Sequence]) -> WorkRequest:
    """The request as it is handed back: the original with its unfinished choices' progress, or the original
    unchanged when none of its choices has started."""
    seqs = sorted(unfinished, key=lambda s: s.choice)
    if not seqs:
        return original
    return original.model_copy(
        update={
            "progress": tuple(
                ChoiceProgress(index=s.choice, output_token_ids=tuple(s.output_ids), next_seq_no=s.target_seq_no)
                for s in seqs
            ),
            "sampling": seqs[0].sampling,  # with the seed this worker drew, if the request had none
        }
    )
