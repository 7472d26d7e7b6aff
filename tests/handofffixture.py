"""Running one request across two engines as a prefill worker and a decode worker would (engine/handoff.py)."""

from __future__ import annotations

from services.worker.engine.engine import Engine, SeqOutput
from services.worker.engine.sequence import Sequence
from shared.schemas import ChoiceProgress, WorkRequest


def run_prefill(engine: Engine, request: WorkRequest) -> tuple[list[SeqOutput], Sequence, bytes]:
    """Runs the request on a prefill engine until it is handed off: its outputs, its sequence and its handoff's
    bytes."""
    outputs, handoffs = [], []
    engine.add_request(request)
    while not handoffs:
        outputs += engine.step()
        handoffs = engine.hand_off_ready()
    ((seqs, payload),) = handoffs
    assert not engine.has_work()
    return outputs, seqs[0], payload


def decode_request(request: WorkRequest, seq: Sequence) -> WorkRequest:
    """The request as its decode worker gets it: where its output stands, with the seed the prefill drew."""
    progress = ChoiceProgress(index=0, output_token_ids=tuple(seq.output_ids), next_seq_no=seq.target_seq_no)
    return request.model_copy(update={"progress": (progress,), "sampling": seq.sampling})
