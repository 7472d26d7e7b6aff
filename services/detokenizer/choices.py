"""A request's choices at the detokenizer: one RequestAssembler per choice, their chunks sent as one stream.

Each choice is assembled on its own (its records carry its index); the request's chunks are numbered by one
counter, so the gateway sees one gapless stream, and the request's last chunk is the one that ends its last
choice, carrying the usage of all of them (the prompt counted once, as OpenAI does). A choice that ends on a stop
string while others go on is cancelled alone at the worker; an error in any choice ends the whole request.
"""

from __future__ import annotations

from services.detokenizer.assembler import Record, RequestAssembler
from services.detokenizer.incremental import TokenTable
from services.detokenizer.speculation import SpeculationTally
from shared.schemas import Cancel, ChoiceProgress, Chunk, DetokOpen, PromptTokensDetails, Usage


class RequestChoices:
    def __init__(self, open_msg: DetokOpen, table: TokenTable) -> None:
        self.request_id = open_msg.request_id
        self.reply_subject = open_msg.reply_subject
        self._num_prompt_tokens = open_msg.num_prompt_tokens
        self._choices = [RequestAssembler(open_msg, table, choice) for choice in range(open_msg.n)]
        self._num_live = open_msg.n
        self._chunk_seq = 0
        self.finished = False
        self._cancels: list[Cancel] = []
        # The worker whose frames count: the first to send some, then each worker that takes the request over. A
        # worker that lost the request (stalled past ack_wait, but alive) may still send frames; they are dropped.
        self.owner: int | None = None
        self.migrations = 0  # times a worker took the request over
        # Deliveries a handoff replaced (migration.py), each with the delivery of the handoff that replaced it
        self.superseded: dict[str, str | None] = {}
        self.taken_through: set[str] = set()  # the work-queue deliveries workers took it over through
        # Workers told to drop it, having sent records after losing it: when they were last told (monotonic)
        self.released: dict[int, float] = {}

    def consume(self, target: Record, draft: Record | None = None) -> Chunk | None:
        """The chunk this record produces for its choice, numbered in the request's stream, or None."""
        if self.finished:
            return None
        if not 0 <= target.choice < len(self._choices):
            error = f"record for choice {target.choice} of a request with {len(self._choices)} choices"
            return self._number(self._choices[0].fail(error), "error")
        assembler = self._choices[target.choice]
        if assembler.finished:
            return None  # the worker had not yet seen this choice's cancel
        chunk = assembler.consume(target, draft)
        if chunk is None:
            return None
        if chunk.error is None and chunk.final:
            self._num_live -= 1
            if assembler.cancel_reason is not None and self._num_live:
                self._cancels.append(
                    Cancel(request_id=self.request_id, reason=assembler.cancel_reason, choice=assembler.choice)
                )
        return self._number(chunk, assembler.cancel_reason)

    def consume_prompt(self, record: Record | None = None) -> list[Chunk]:
        """The chunks of the prompt's part (echo, prompt_logprobs) that this PROMPT record, or what is known already,
        makes ready, for every choice: each choice shows the whole prompt."""
        chunks: list[Chunk] = []
        for assembler in self._choices:
            for chunk in assembler.consume_prompt(record):
                if self.finished:
                    return chunks
                chunks.append(self._number(chunk))
        return chunks

    def from_owner(self, worker_id: int) -> bool:
        """Whether frames of this worker count for the request; the first worker to send any becomes its owner."""
        if self.owner is None:
            self.owner = worker_id
        return worker_id == self.owner

    def take_over(
        self, worker_id: int, delivery: str | None, migration: bool = True
    ) -> tuple[ChoiceProgress, ...]:
        """Makes `worker_id`, holding `delivery` of the request, the owner and returns where each unfinished choice
        stands, for it to continue from; counts a migration unless the move was planned (a prefill worker's
        handoff)."""
        self.owner = worker_id
        self.released.pop(worker_id, None)  # it owns the request again: losing it again needs a release again
        if delivery is not None:
            self.taken_through.add(delivery)
        self.migrations += migration
        return tuple(c.progress() for c in self._choices if not c.finished)

    def fail(self, error: str) -> Chunk:
        """The chunk that ends the unfinished request with an error, on one of its running choices."""
        running = next(c for c in self._choices if not c.finished)
        return self._number(running.fail(error), "error")

    def take_cancels(self) -> list[Cancel]:
        """The cancels to publish after the last chunk: choices ended here while the worker still generates."""
        cancels, self._cancels = self._cancels, []
        return cancels

    def _number(self, chunk: Chunk, cancel_reason: str | None = None) -> Chunk:
        """The chunk as the request's next one; it is final when it ends the request (its last choice, or an error)."""
        if chunk.error is not None:
            self.finished = True
            # A choice the worker ended itself needs no cancel, unless other choices are still running there.
            if cancel_reason is not None or len(self._choices) > 1:
                self._cancels.append(Cancel(request_id=self.request_id, reason="error"))
        elif chunk.final and not self._num_live:
            self.finished = True
            if cancel_reason is not None:
                self._cancels.append(Cancel(request_id=self.request_id, reason=cancel_reason))
        if len(self._choices) == 1:
            self._chunk_seq += 1
            return chunk  # its own numbering and usage are the request's
        numbered = chunk.model_copy(
            update={
                "seq": self._chunk_seq,
                "final": self.finished,
                "usage": self._usage() if self.finished and chunk.error is None else None,
            }
        )
        self._chunk_seq += 1
        return numbered

    def _usage(self) -> Usage:
        completion = sum(c.num_output_tokens for c in self._choices)
        prompt = self._num_prompt_tokens
        tallies = [c.speculation for c in self._choices if c.speculation is not None]
        predicted = [details for c in self._choices if (details := c.prediction_details) is not None]
        return Usage(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
            # The prompt is counted once, as its first choice found it.
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self._choices[0].num_cached_tokens),
            completion_tokens_details=sum(predicted[1:], predicted[0]) if predicted else None,
            speculative=SpeculationTally.merged(tallies).usage() if tallies else None,
        )
