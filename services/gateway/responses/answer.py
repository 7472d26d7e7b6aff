"""A Responses request's answer: its chat answer's chunks, split by the reasoning parser and the tool-call reader as a
chat answer's are, made into output items (output.py), and sent as the Responses API's named server-sent events or as
one response object; a streamed background response's events go to the event log (event_log.py) instead, for its
clients to read from there.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from services.gateway import sse
from services.gateway.answer import ChoiceReader
from services.gateway.cancelling import to_the_end
from services.gateway.choices import ResponseChoices
from services.gateway import wire_json
from services.gateway.errors import SERVER_ERROR, OpenAIError
from services.gateway.in_flight import Generation
from services.gateway.latency import ResponseLatency
from services.gateway.reasoning.parser import ReasoningFormat
from services.gateway.responses.output import Event, ResponseOutput, responses_usage
from services.gateway.router import ResponseStream
from services.gateway.tools.formats import ToolFormat

log = logging.getLogger(__name__)

RESPONSES_API = "responses"  # the latency metrics' label of /v1/responses (chat, completion for the others)
INTERNAL_ERROR = 500
# Counts the reasoning tokens of an answer from its token ids and its reasoning text.
ReasoningCounter = Callable[[list[int], str], int]
# Keeps a finished response (store.py) before the client hears it is done; False where it could not.
Keeper = Callable[[ResponseOutput], Awaitable[bool]]
# Takes a background response's events in order (event_log.EventWriter.put).
EventSink = Callable[[list[Event]], None]


RESPONSE_ID_PREFIX = "resp_"


@dataclass
class ResponsesAnswer:
    """How one Responses request is answered: the parameters its response object shows, and what reads its chat
    answer. `output` is the response, once the answer began."""

    shown: dict[str, Any]
    with_draft_logprobs: bool
    count_reasoning: ReasoningCounter
    keep: Keeper | None = None  # store: true
    # Made before the request runs (a background response, queued); else once its answer begins
    output: ResponseOutput | None = None
    admitted: Keeper | None = None  # told once the response runs (a background one is written in_progress)
    events: EventSink | None = None  # where a streamed background response's events go

    async def __call__(
        self, request: web.Request, gens: list[Generation], choices: ResponseChoices, chunks: ResponseStream,
        model: str, tool_format: ToolFormat | None, reasoning_format: ReasoningFormat | None = None,
    ) -> web.StreamResponse:
        """Answer's signature (services/gateway/answer.py), for Generator."""
        gen = gens[0]  # a Responses request is one prompt with one choice
        if self.output is None:
            self.output = ResponseOutput(
                RESPONSE_ID_PREFIX + gen.request_id, gen.created, self.shown, self.with_draft_logprobs,
            )
            first = self.output.started()
        else:  # a background response's: it was created, and queued, when the request was validated
            first = self.output.progressing()
        reader = _ChatReader(gen, tool_format, reasoning_format)
        if self.admitted is not None:
            await self.admitted(self.output)
        if self.events is not None:
            self.events(first)
            return await self._respond(gen, choices, chunks, reader)
        if gen.body.stream:
            return await self._stream(request, gen, choices, chunks, reader, first)
        return await self._respond(gen, choices, chunks, reader)

    async def _stream(
        self, request: web.Request, gen: Generation, choices: ResponseChoices, chunks: ResponseStream,
        reader: "_ChatReader", first: list[Event],
    ) -> web.StreamResponse:
        response = await sse.open_stream(request)
        latency = ResponseLatency(RESPONSES_API, gen.started)
        output = self.output
        # At once, as OpenAI sends them: a client sees its response exist while the prompt waits or computes.
        await response.write(b"".join(map(named_event, first)))
        unsent: list[bytes] = []
        try:
            async for chunk in chunks:
                latency.observe(chunk)
                choices.observe(chunk)
                choice = reader.read(choices.streamed(chunk))
                unsent += map(named_event, output.feed(choice))
                if not chunks.finished:
                    await sse.write_caught_up(response, unsent, chunks.has_ready)
                    continue
                latency.finished()
                last = await self._finish(choice.get("finish_reason"), self._usage(choices, reader))
                unsent += map(named_event, last)
        except OpenAIError as exc:
            unsent += map(named_event, output.fail(exc.body()["error"]))
        except ConnectionResetError:
            raise
        except Exception:
            log.exception("response %s failed while streaming", output.response_id)
            error = OpenAIError(INTERNAL_ERROR, "Internal error", type=SERVER_ERROR).body()["error"]
            unsent += map(named_event, output.fail(error))
        await response.write_eof(b"".join(unsent))
        return response

    async def _respond(
        self, gen: Generation, choices: ResponseChoices, chunks: ResponseStream, reader: "_ChatReader",
    ) -> web.Response:
        latency = ResponseLatency(RESPONSES_API, gen.started)
        choice: dict[str, Any] = {}
        async for chunk in chunks:
            latency.observe(chunk)
            choices.observe(chunk)
            choice = reader.read(choices.streamed(chunk))
            self._emit(self.output.feed(choice))
        latency.finished()
        self._emit(await self._finish(choice.get("finish_reason"), self._usage(choices, reader)))
        return web.json_response(self.output.snapshot(), dumps=wire_json.dumps_text)

    def _emit(self, events: list[Event]) -> None:
        if self.events is not None:
            self.events(events)

    def _usage(self, choices: ResponseChoices, reader: "_ChatReader") -> dict[str, Any]:
        return responses_usage(choices.usage(), self.count_reasoning(reader.token_ids, reader.reasoning))

    async def _finish(self, finish_reason: str | None, usage: dict[str, Any]) -> list[Event]:
        """The closing events, once the response is kept. Kept to the end (a background response's last state)
        whatever cancellation comes meanwhile, which then finds it ended: its events go out all the same."""
        events = self.output.finish(finish_reason, usage)
        if self.keep is None:
            return events
        keeping = asyncio.ensure_future(self.keep(self.output))
        try:
            kept = await to_the_end(keeping)
        except asyncio.CancelledError:
            if not keeping.cancelled() and keeping.exception() is None:
                self._emit(self._marked_kept(events, keeping.result()))
            raise
        return self._marked_kept(events, kept)

    def _marked_kept(self, events: list[Event], kept: bool) -> list[Event]:
        if not kept:
            self.output.shown["store"] = events[-1]["response"]["store"] = False
        return events


class _ChatReader:
    """One chat answer's choices as a chat stream sends them, with its reasoning and calls split out (answer.py's
    ChoiceReader); keeps the answer's token ids and reasoning text for the usage."""

    def __init__(self, gen: Generation, tools: ToolFormat | None, reasoning: ReasoningFormat | None) -> None:
        self._choices = ChoiceReader(gen.body, tools, reasoning, include=True)
        self.token_ids: list[int] = []
        self.reasoning = ""

    def read(self, choice: dict[str, Any]) -> dict[str, Any]:
        self.token_ids += choice.get("token_ids") or ()
        choice = self._choices.read(choice)
        self.reasoning += (choice.get("delta") or {}).get("reasoning") or ""
        return choice


def named_event(event: Event) -> bytes:
    """A named event, as the Responses API streams them (no [DONE] after the last)."""
    return b"event: " + event["type"].encode() + b"\ndata: " + wire_json.dumps(event) + b"\n\n"
