"""An engine step that raises costs only the request it comes from, and never the worker.

A step serves a batch, so an exception inside it belongs to one of the batch's requests (a bug that one request's
values bring out) or to none of them. Before each step the guard notes where every unfinished choice stands: the
tokens its client has been sent and the number of its next TARGET record. When the step raises, every request in
the engine goes back to that point: its sequences are aborted and the request is set aside in the form a draining
worker hands a request back in (its progress), from which the engine recomputes the cache and continues the same
output, as it does after a preemption or on another worker. Then each request that took part in the step is tried
alone through its prefill and PROBE_STEPS_AFTER_PREFILL steps more, whose results are thrown away: one that fails
alone is the culprit and ends with an error; the others resume. When every one of them passes alone, the failure
cannot be pinned on one request, and all of them end with an error. Requests that only waited resume.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

from shared.schemas import ChoiceProgress, WorkRequest
from services.worker.engine.engine import Engine
from services.worker.engine.sequence import Sequence, SeqState
from services.worker.tensor_parallel.errors import RankFailed

log = logging.getLogger("specmesh.worker")
R = TypeVar("R")

# A fresh request's last prefill step samples its first token; the step after drafts and verifies. A long prompt
# is prefilled over several steps (chunked prefill): the probe runs those too.
PROBE_STEPS_AFTER_PREFILL = 2


class Mark(NamedTuple):
    """Where one unfinished choice stood before a step (a tuple: one is made per sequence and step)."""

    seq: Sequence
    num_sent: int  # output tokens already in frames
    next_seq_no: int
    ran: bool  # it held a cache slot: part of the step's batch


@dataclass(frozen=True)
class Recovery:
    """What a failed step leaves: requests ending with an error and requests resuming, each as it stood before the
    step (progress: tokens sent, next record number, the seed drawn)."""

    failed: list[WorkRequest]
    resumed: list[WorkRequest]


class StepGuard(Generic[R]):
    """Admits requests into the engine and runs its steps; engine process only."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._requests: dict[str, WorkRequest] = {}  # every request in the engine, as it was last admitted

    def admit(self, request: WorkRequest, handoff: bytes | None = None) -> list[Sequence]:
        """engine.add_request, remembered so the request can be set back; raises what add_request raises."""
        seqs = self.engine.add_request(request, handoff)
        self._requests[request.request_id] = request
        return seqs

    def forget(self, request_id: str) -> None:
        """The request left the engine (finished, cancelled, failed)."""
        self._requests.pop(request_id, None)

    def run(self, step: Callable[[], R]) -> tuple[R | None, Recovery | None]:
        """step()'s result, or, when it raises, None and what the recovery did. `step` runs the engine for one
        step and must leave the caller's own bookkeeping alone: it is also how each request is tried alone."""
        marks = self._marks()
        try:
            return step(), None
        except RankFailed:
            raise  # the engine itself is broken, not by any request: the worker must learn it
        # A step runs the model, sampling, drafting and frame building: whatever any of them raises is one request's
        # failure or the batch's, never the worker's.
        except Exception:
            log.exception("engine step %d failed; trying its requests one by one", self.engine.step_no)
        return None, self._recover(marks, step)

    def _marks(self) -> dict[str, list[Mark]]:
        marks: dict[str, list[Mark]] = defaultdict(list)
        scheduler = self.engine.scheduler
        for seq in [*scheduler.running, *scheduler.waiting]:
            if not seq.is_finished:
                marks[seq.request_id].append(
                    Mark(seq, len(seq.output_ids), seq.target_seq_no, seq.state is SeqState.RUNNING)
                )
        return marks

    def _recover(self, marks: dict[str, list[Mark]], step: Callable[[], R]) -> Recovery:
        standing = {request_id: self._standing(request_id, choices) for request_id, choices in marks.items()}
        # A sequence admitted by the failed step runs now; one preempted by it ran before.
        in_step = [
            request_id for request_id, choices in marks.items()
            if any(m.ran or m.seq.state is SeqState.RUNNING for m in choices)
        ]
        self._clear()
        culprits = [request_id for request_id in in_step if self._fails_alone(standing[request_id], step)]
        if not culprits:
            log.error("every request of the failed step passes alone: ending all %d of them", len(in_step))
            culprits = in_step
        resumed = []
        for request_id, request in standing.items():
            if request_id in culprits:
                continue
            try:
                self.admit(request)
                resumed.append(request)
            except ValueError:
                culprits.append(request_id)  # it was admitted as it stood before; not taking it back is a bug too
        for request_id in culprits:
            log.error("request %s fails the engine step; ending it", request_id)
            self.forget(request_id)
        return Recovery([standing[request_id] for request_id in culprits], resumed)

    def _standing(self, request_id: str, choices: list[Mark]) -> WorkRequest:
        """The request as it stood at the marks: the form in which it resumes, or in which it ends."""
        progress = tuple(
            ChoiceProgress(index=m.seq.choice, output_token_ids=tuple(m.seq.output_ids[: m.num_sent]),
                           next_seq_no=m.next_seq_no)
            for m in sorted(choices, key=lambda m: m.seq.choice)
        )
        # The sampling the engine ran with carries the seed it drew for a request that had none.
        return self._requests[request_id].model_copy(update={"progress": progress, "sampling": choices[0].seq.sampling})

    def _prefill_steps(self, request: WorkRequest) -> int:
        """Steps the request's prefill takes alone in the engine, at most."""
        config = self.engine.config
        if not config.enable_chunked_prefill:
            return 1
        tokens = len(request.prompt_token_ids) + max((len(c.output_token_ids) for c in request.choices()), default=0)
        return -(-tokens * request.num_choices // config.max_num_batched_tokens)

    def _fails_alone(self, request: WorkRequest, step: Callable[[], R]) -> bool:
        """Runs the request alone in the engine for a few steps, then takes it out again; True if it failed."""
        try:
            self.engine.add_request(request)
            for _ in range(self._prefill_steps(request) - 1 + PROBE_STEPS_AFTER_PREFILL):
                if self.engine.has_work():
                    step()
        except RankFailed:
            raise
        # The probe exists to catch the failure again: any exception names this request.
        except Exception:
            log.warning("request %s fails alone", request.request_id, exc_info=True)
            failed = True
        else:
            failed = False
        self._clear()
        return failed

    def _clear(self) -> None:
        """Aborts every unfinished sequence: the next engine step releases their slots and blocks."""
        scheduler = self.engine.scheduler
        for request_id in {s.request_id for s in [*scheduler.running, *scheduler.waiting] if not s.is_finished}:
            self.engine.abort(request_id)
