"""One request's state at the detokenizer: from its joined frame records to OpenAI-shaped chunks."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import numpy as np

from services.detokenizer import logprobs
from services.detokenizer.incremental import DecodedStep, IncrementalDecoder, TokenTable
from services.detokenizer.prompt import PromptAssembler, PromptLogprob, PromptPart, wants_prompt
from services.detokenizer.speculation import SpeculationTally
from services.detokenizer.stop import Released, StopMatcher
from shared.frames import NO_TOKEN, WHEREVER, FinishReason, Frame, SeqStatus
from shared.prediction import prediction_usage
from shared.schemas import ChoiceProgress, Chunk, CompletionTokensDetails, DetokOpen, PromptTokensDetails, Usage

FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.COMPLETE: "stop"}
STOP_STRING_FINISH = "stop"
# vLLM's stop_reason beside a "stop" finish: the stop string or stop token id that ended the output; None for the
# tokenizer's EOS, or a finish of another kind
StopReason = str | int | None
CONSTRAINT_FAILED_ERROR = (
    "the output's constraint cannot be followed past this point: it reaches a limit of the grammar engine "
    "(llguidance), such as 2,000 alternatives of one rule"
)
# By value, for records whose fields decode() has already checked.
_STATUSES = {int(s): s for s in SeqStatus}
_FINISH_REASONS = {int(r): r for r in FinishReason}

CancelReason = Literal["stop_string", "error"]


@dataclass(frozen=True)
class Record:
    """One request's part of a frame; the arrays are views into the received buffer."""

    seq_no: int
    offset: int
    num_accepted: int
    status: SeqStatus
    finish_reason: FinishReason
    token_ids: np.ndarray  # [n, num_slots]
    logprobs: np.ndarray  # [n, num_slots]
    ranks: np.ndarray  # [n]
    ids: list[int]  # token_ids[:, 0] as Python ints: the record's tokens
    choice: int = 0  # which of the request's choices
    num_cached: int = 0  # a choice's first TARGET record: prompt tokens found in the worker's prefix cache

    @classmethod
    def from_row(cls, rec: np.void, token_ids: np.ndarray, logprobs: np.ndarray, ranks: np.ndarray) -> "Record":
        return cls(
            int(rec["seq_no"]),
            int(rec["offset"]),
            int(rec["num_accepted"]),
            SeqStatus(int(rec["status"])),
            FinishReason(int(rec["finish_reason"])),
            token_ids,
            logprobs,
            ranks,
            token_ids[:, 0].tolist(),
            int(rec["choice"]),
            int(rec["num_cached"]),
        )

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    @property
    def finished(self) -> bool:
        return self.status == SeqStatus.FINISHED


def frame_records(frame: Frame) -> Iterator[tuple[str, Record]]:
    """(request id, record) for every record of a decoded frame, in one pass: the header fields and the tokens of
    all records become Python values in one conversion each, instead of one numpy access per field and record."""
    tokens = frame.token_ids[:, 0].tolist()
    start = 0
    for raw_id, seq_no, offset, num_tokens, num_accepted, status, finish_reason, choice, num_cached in (
        frame.records.tolist()
    ):
        end = start + num_tokens
        rows = slice(start, end)
        yield raw_id.hex(), Record(
            seq_no, offset, num_accepted, _STATUSES[status], _FINISH_REASONS[finish_reason],
            frame.token_ids[rows], frame.logprobs[rows], frame.ranks[rows], tokens[start:end], choice, num_cached,
        )
        start = end


@dataclass(frozen=True)
class _Held:
    """A logprobs entry waiting until its token's text is released (or cut by a stop string)."""

    entry: logprobs.Entry
    start: int
    end: int


class RequestAssembler:
    """Consumes one choice's TARGET records in order (each with the DRAFT record of its step) into chunks; a request
    with several choices has one per choice (services/detokenizer/choices.py)."""

    def __init__(self, open_msg: DetokOpen, table: TokenTable, choice: int = 0) -> None:
        self.request_id = open_msg.request_id
        self.choice = choice
        self.reply_subject = open_msg.reply_subject
        self._open = open_msg
        self._table = table
        shown = open_msg.shown_special_ids if open_msg.skip_special_tokens else table.special_names
        self._decoder = IncrementalDecoder(table, shown)
        # Control tags shown for the gateway's parser alone: stop strings are matched in the client's text only
        self._parser_tags = frozenset(open_msg.shown_special_ids) if open_msg.skip_special_tokens else frozenset()
        self._stop = StopMatcher(open_msg.stop, include=open_msg.include_stop_str_in_output)
        self._top_k = open_msg.logprobs
        self._want_drafts = open_msg.include_draft_logprobs and open_msg.logprobs is not None
        self._prompt = PromptAssembler(open_msg, table) if wants_prompt(open_msg) else None
        self._text_base = 0  # characters of echoed prompt before the generated text
        self._tokens_seen = 0  # tokens of accepted TARGET records, i.e. the output length the worker reported
        self._output_ids: list[int] = []  # those tokens: where a worker taking the request over continues from
        self._next_seq_no = 0
        self._held: deque[_Held] = deque()
        self._drafts: list[logprobs.Entry] = []  # drafted tokens of the steps since the last chunk
        self._unsent_tokens = 0  # tokens consumed since the last chunk
        self._unsent_ids: list[int] = []  # their ids, kept when the request asked for them
        self._chunk_seq = 0
        self.finished = False
        # Set when this side ended the request while the worker may still be generating for it.
        self.cancel_reason: CancelReason | None = None
        self.speculation = SpeculationTally() if open_msg.speculative_stats else None
        self.num_cached_tokens = 0  # of the prompt, as the worker's first record of this choice reports

    def consume(self, target: Record, draft: Record | None = None) -> Chunk | None:
        """The chunk this step produces, or None when it produced nothing to send yet (or was a duplicate)."""
        if self.finished:
            return None
        if target.finished and target.seq_no == WHEREVER:
            return self.fail(f"the worker ended the request ({target.finish_reason.name}) after giving up on it")
        if self._is_duplicate(target):
            return None
        if self._prompt is not None and not self._prompt.done:
            return self.fail(self._prompt.missing)
        if problem := self._out_of_order(target) or self._bad_ids(target) or (draft and self._bad_ids(draft)):
            return self.fail(problem)
        self._next_seq_no += 1
        if target.offset == 0:
            self.num_cached_tokens = target.num_cached
        if draft is not None and self.speculation is not None:
            self.speculation.observe(draft.num_tokens, draft.num_accepted)
        ids = target.ids
        # A STOP finish means the last token is EOS or a stop token id: counted, rendered only when the request
        # includes what stopped it.
        stopped = target.finish_reason == FinishReason.STOP and target.finished and ids
        rendered = ids[:-1] if stopped and not self._open.include_stop_str_in_output else ids
        step = self._decoder.step(rendered, final=target.finished)
        self._hold_entries(target, rendered, step)
        if draft is not None and self._want_drafts:
            self._add_drafts(target, draft, step)
        released, completing = self._find_stop(step, rendered, final=target.finished)
        if released.match is not None:
            self._count(ids if completing is None else ids[: completing + 1])
            self.cancel_reason = "stop_string"
            cut = self._text_base + released.match.cut
            self._drafts = [d for d in self._drafts if d.text_offset < cut]
            return self._emit(
                released.text, self._release_before(released.match.cut), STOP_STRING_FINISH, released.match.stop
            )
        self._count(ids)
        if not target.finished:
            return self._emit(released.text, self._release_settled())
        items = [h.entry for h in self._held]
        self._held.clear()
        if target.finish_reason in FINISH_REASONS:
            stop_reason = self._stop_token(ids[-1]) if stopped else None
            return self._emit(released.text, items, FINISH_REASONS[target.finish_reason], stop_reason)
        if target.finish_reason is FinishReason.CONSTRAINT_FAILED:
            return self._emit(released.text, items, error=CONSTRAINT_FAILED_ERROR, request_error=True)
        return self._emit(released.text, items, error=f"the worker ended the request ({target.finish_reason.name})")

    def _stop_token(self, token_id: int) -> int | None:
        """vLLM's stop_reason of a finish on a token: the stop token's id, None for the tokenizer's own EOS."""
        return None if token_id == self._table.eos_token_id else token_id

    def consume_prompt(self, record: Record | None = None) -> list[Chunk]:
        """The chunks of the prompt's part (echo, prompt_logprobs) that this PROMPT record, or what is known already,
        makes ready. Called for every PROMPT record and before every TARGET record: a prompt without scores is known
        from the start and goes out just before the first generated tokens."""
        if self.finished:
            return []
        if self._prompt is None:
            return [] if record is None else [self.fail("PROMPT record for a request that asked for no prompt")]
        if record is not None and (problem := self._prompt.add(record)):
            return [self.fail(problem)]
        return [self._emit_prompt(part) for part in self._prompt.take()]

    def fail(self, error: str) -> Chunk:
        """Ends the request with an error chunk; text still held back is not sent."""
        self._held.clear()
        self.cancel_reason = "error"
        return self._emit("", [], error=error)

    def _is_duplicate(self, target: Record) -> bool:
        """A record whose tokens were all seen already, as a resumed request's new worker may resend."""
        end = target.offset + target.num_tokens
        if target.num_tokens:
            return end <= self._tokens_seen
        return target.offset < self._tokens_seen or target.seq_no < self._next_seq_no

    def _out_of_order(self, target: Record) -> str | None:
        if target.offset != self._tokens_seen or target.seq_no != self._next_seq_no:
            return (
                f"lost frames: expected TARGET record seq_no {self._next_seq_no} at offset {self._tokens_seen}, "
                f"got seq_no {target.seq_no} at offset {target.offset}"
            )
        return None

    def _bad_ids(self, record: Record) -> str | None:
        """A token, or a top-K alternative the request uses, outside the vocabulary (an empty slot is NO_TOKEN)."""
        vocab = self._table.vocab_size
        bad = bool(record.ids) and (min(record.ids) < 0 or max(record.ids) >= vocab)
        if not bad and self._top_k:
            # A few ids per token: Python on one list beats numpy's per-call cost here.
            top = record.token_ids[:, 1 : 1 + self._top_k].tolist()
            bad = any(not (0 <= t < vocab or t == NO_TOKEN) for row in top for t in row)
        return f"token id outside the vocabulary of {vocab} in record seq_no {record.seq_no}" if bad else None

    @property
    def num_output_tokens(self) -> int:
        """Tokens of this choice consumed so far: its completion_tokens."""
        return self._tokens_seen

    def progress(self) -> ChoiceProgress:
        """Where this choice's output stands: the tokens consumed (sent, or held back for a stop string) and the
        number of the next TARGET record."""
        return ChoiceProgress(
            index=self.choice, output_token_ids=tuple(self._output_ids), next_seq_no=self._next_seq_no
        )

    def _count(self, ids: list[int]) -> None:
        self._tokens_seen += len(ids)
        self._output_ids += ids
        self._unsent_tokens += len(ids)
        if self._open.return_token_ids:
            self._unsent_ids += ids

    def _hold_entries(self, target: Record, rendered: list[int], step: DecodedStep) -> None:
        if self._top_k is None:
            return
        shows_special = not self._open.skip_special_tokens
        keep = [i for i, t in enumerate(rendered) if shows_special or not self._table.is_special(t)]
        if not keep:
            return
        starts = [self._text_base + step.spans[i][0] for i in keep]
        made = logprobs.entries(target.token_ids[keep], target.logprobs[keep], self._top_k, starts)
        self._held.extend(_Held(e, *step.spans[i]) for e, i in zip(made, keep))

    def _add_drafts(self, target: Record, draft: Record, step: DecodedStep) -> None:
        # A draft stands where the target token of the same position stands; drafts past the first
        # rejected one never got a position, so they share the one where the text diverged from them.
        end = self._text_base + self._decoder.length  # where the text stands after this step
        starts = [self._text_base + start for start, _ in step.spans]
        starts += [end] * (target.num_tokens - len(starts))
        last = min(target.num_accepted, target.num_tokens - 1)
        offsets = [starts[min(j, last)] if last >= 0 else end for j in range(draft.num_tokens)]
        accepted = [j < draft.num_accepted for j in range(draft.num_tokens)]
        self._drafts.extend(logprobs.entries(draft.token_ids, draft.logprobs, self._top_k, offsets, accepted))

    def _find_stop(self, step: DecodedStep, ids: list[int], final: bool) -> tuple[Released, int | None]:
        """Feeds the step's text to the stop matcher a token at a time, up to the first token that completes a stop
        string: which stop ends the output, and where, must not depend on how many tokens a step accepted. Returns
        what the matcher released and the index of the token that completed a match (None: the step's last)."""
        # No stop string may end in the text of the first min_tokens tokens (vLLM's rule): of this step's tokens
        # (one span each), the first `within` are among them; _tokens_seen counts the tokens before the step
        within = self._open.min_tokens - self._tokens_seen
        if not step.spans or not self._stop.active:  # no token rendered (only the bytes a final step flushed)
            return self._stop.feed(step.text, final=final, may_stop=len(ids) > within), None
        base = step.spans[0][0]
        texts = []
        for i, (start, end) in enumerate(step.spans):
            piece = step.text[start - base : end - base]
            if ids[i] in self._parser_tags:
                texts.append(self._stop.pass_through(piece).text)
                continue
            released = self._stop.feed(piece, final=final and i == len(step.spans) - 1, may_stop=i + 1 > within)
            texts.append(released.text)
            if released.match is not None:
                return Released("".join(texts), released.match), i
        return Released("".join(texts), None), None

    def _release_settled(self) -> list[logprobs.Entry]:
        """Entries whose text has been released in full (a token with no text of its own waits for the next)."""
        released = self._stop.released
        out = []
        while self._held and self._held[0].end <= released and self._held[0].start < released:
            out.append(self._held.popleft().entry)
        return out

    def _release_before(self, cut: int) -> list[logprobs.Entry]:
        """Entries of tokens that begin before a stop string; tokens entirely after it are dropped."""
        out = [h.entry for h in self._held if h.start < cut]
        self._held.clear()
        return out

    def _emit(
        self, text: str, items: list[logprobs.Entry], finish: str | None = None, stop_reason: StopReason = None,
        error: str | None = None, request_error: bool = False,
    ) -> Chunk | None:
        final = finish is not None or error is not None
        if not final and not text and not items:
            return None
        chunk = Chunk(
            request_id=self.request_id,
            seq=self._chunk_seq,
            final=final,
            choice=self._choice(text, items, finish, stop_reason),
            num_tokens=self._unsent_tokens,
            usage=self._usage() if final else None,
            error=error,
            request_error=request_error,
        )
        self._chunk_seq += 1
        self._unsent_tokens = 0
        self._unsent_ids = []
        self._drafts = []
        self.finished = final
        return chunk

    def _emit_prompt(self, part: PromptPart) -> Chunk:
        self._text_base += len(part.text)
        chunk = Chunk(
            request_id=self.request_id,
            seq=self._chunk_seq,
            choice=self._choice(part.text, part.entries, None, prompt=part.prompt_logprobs),
        )
        self._chunk_seq += 1
        return chunk

    def _choice(
        self, text: str, items: list[logprobs.Entry], finish: str | None, stop_reason: StopReason = None,
        prompt: list[PromptLogprob] | None = None,
    ) -> dict:
        api = self._open.api
        choice: dict = {"index": self.choice}
        if api == "chat":
            choice["delta"] = {"content": text} if text else {}
        else:
            choice["text"] = text
        as_ids = self._open.tokens_as_token_ids
        choice["logprobs"] = (
            None if self._top_k is None else logprobs.render(api, self._table, items, draft=False, as_ids=as_ids)
        )
        choice["finish_reason"] = finish
        if finish is not None:
            choice["stop_reason"] = stop_reason
        if self._want_drafts:
            choice["draft_logprobs"] = logprobs.render(api, self._table, self._drafts, draft=True, as_ids=as_ids)
        if self._open.return_token_ids:
            choice["token_ids"] = self._unsent_ids
        if prompt is not None:
            choice["prompt_logprobs"] = prompt
        return choice

    def _usage(self) -> Usage:
        prompt = self._open.num_prompt_tokens
        return Usage(
            prompt_tokens=prompt, completion_tokens=self._tokens_seen, total_tokens=prompt + self._tokens_seen,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.num_cached_tokens),
            completion_tokens_details=self.prediction_details,
            speculative=None if self.speculation is None else self.speculation.usage(),
        )

    @cached_property
    def prediction_details(self) -> CompletionTokensDetails | None:
        """How much of the request's prediction this choice's answer used; None without a prediction. Read once the
        choice has finished (its final chunk's usage, then the request's over all its choices), counted once."""
        prediction = self._open.prediction_token_ids
        return None if prediction is None else prediction_usage(prediction, self._output_ids)
