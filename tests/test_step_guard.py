"""StepGuard on the tiny checkpoint: an engine step that raises costs only the request it comes from. The others go
on with exactly the tokens an undisturbed run gives them, from where their clients stand; a failure no single request
reproduces ends the requests of that step and no others; the engine serves new requests afterwards."""

from __future__ import annotations

from pathlib import Path

from services.worker.engine.engine import Engine, SeqOutput
from services.worker.step_guard import Recovery, StepGuard
from shared.schemas import WorkRequest
from tests.methodfixture import GREEDY, METHODS, MAX_STEPS, make_engine, make_request, prompts, run, tokens_of
from tests.modelfixture import tiny_model_dir
from tests.threadfixture import single_thread

__all__ = ["prompts", "single_thread", "tiny_model_dir"]  # fixtures, imported for pytest to find

NUM_TOKENS = 24
CORRUPT_AT_STEP = 3  # after a few steps, so the failing requests have output their clients already hold
OUT_OF_VOCAB = 7  # how far past the vocabulary the corrupted token lies


def _requests(prompts: list[list[int]], count: int) -> list[WorkRequest]:
    return [make_request(prompt, max_tokens=NUM_TOKENS, **GREEDY) for prompt in prompts[:count]]


def _reference(engine: Engine, requests: list[WorkRequest]) -> dict[str, list[int]]:
    steps = run(engine, {0: requests})
    return {r.request_id: tokens_of(steps, r) for r in requests}


class Client:
    """What the clients of a guarded engine receive: each request's tokens, checked to continue where they stood."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.recoveries: list[Recovery] = []

    def take(self, outputs: list[SeqOutput]) -> None:
        for out in outputs:
            tokens = self.tokens.setdefault(out.seq.request_id, [])
            assert out.offset == len(tokens), "a resumed request must continue where its client stands"
            tokens += out.tokens

    def drive(self, engine: Engine, guard: StepGuard, step, before_step=None) -> None:
        """Steps the guarded engine until it has no work; before_step(i) runs before step i."""
        for i in range(MAX_STEPS):
            if not engine.has_work():
                return
            if before_step is not None:
                before_step(i)
            outputs, recovery = guard.run(step)
            if outputs is not None:
                self.take(outputs)
            if recovery is not None:
                self.recoveries.append(recovery)
        raise AssertionError("the engine stopped making progress")


def test_a_request_that_breaks_the_step_fails_alone_and_the_others_continue(
    tiny_model_dir: Path, prompts: list[list[int]]
) -> None:
    engine = make_engine(tiny_model_dir, METHODS["ngram"])
    requests = _requests(prompts, 3)
    expected = _reference(engine, [r.model_copy() for r in requests])
    guard = StepGuard(engine)
    for request in requests:
        guard.admit(request)
    victim = requests[1]

    def corrupt(step: int) -> None:
        # A value no check let through (an engine bug, a flipped bit): the embedding raises IndexError on it.
        if step == CORRUPT_AT_STEP:
            seq = next(s for s in engine.scheduler.running if s.request_id == victim.request_id)
            seq.output_ids[-1] = engine.vocab_size + OUT_OF_VOCAB

    client = Client()
    client.drive(engine, guard, engine.step, corrupt)

    [recovery] = client.recoveries
    assert [r.request_id for r in recovery.failed] == [victim.request_id]
    assert sorted(r.request_id for r in recovery.resumed) == sorted(r.request_id for r in requests if r is not victim)
    for request in requests:
        if request is not victim:
            assert client.tokens[request.request_id] == expected[request.request_id]
    sent = client.tokens[victim.request_id]
    assert sent and sent == expected[victim.request_id][: len(sent)]  # what it had before it broke

    late = make_request(prompts[3], max_tokens=NUM_TOKENS, **GREEDY)
    guard.admit(late)
    client.drive(engine, guard, engine.step)
    assert client.tokens[late.request_id] == _reference(engine, [late.model_copy()])[late.request_id]


def test_a_failure_no_request_reproduces_alone_ends_that_steps_requests_only(
    tiny_model_dir: Path, prompts: list[list[int]]
) -> None:
    engine = make_engine(tiny_model_dir, METHODS["ngram"], max_num_seqs=2)
    requests = _requests(prompts, 3)  # two run, the third waits for a slot
    expected = _reference(engine, [r.model_copy() for r in requests])
    guard = StepGuard(engine)
    for request in requests:
        guard.admit(request)

    def batched_step() -> list[SeqOutput]:
        """The engine's step, failing after any step that served more than one sequence: a fault of the batch's
        shape, which no request brings out alone. The step has already appended its tokens when it raises."""
        outputs = engine.step()
        if len(outputs) > 1:
            raise RuntimeError("a fault of batched steps")
        return outputs

    client = Client()
    client.drive(engine, guard, batched_step)

    [recovery] = client.recoveries
    assert sorted(r.request_id for r in recovery.failed) == sorted(r.request_id for r in requests[:2])
    assert [r.request_id for r in recovery.resumed] == [requests[2].request_id]
    assert requests[0].request_id not in client.tokens and requests[1].request_id not in client.tokens
    assert client.tokens[requests[2].request_id] == expected[requests[2].request_id]
