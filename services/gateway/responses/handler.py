"""POST /v1/responses: a Responses request is read, turned into the chat request it stands for
(conversation.py), with the conversation it continues (store.py), served by the chat path (generation.py) and
answered as a response (answer.py), which the store keeps unless the request says `store: false`. A background
response (background.py) is answered once it is validated, with its queued response object, or with its events as
the event log keeps them (event_log.py), which GET streams again from any gateway.

Errors the chat path finds name chat's parameters; they reach the client under the Responses API's names.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Mapping
from contextlib import aclosing
from typing import Any

from aiohttp import web
from nats.aio.client import Client

from services.gateway import sse, wire_json
from services.gateway.errors import UNAVAILABLE, OpenAIError, bad_request
from services.gateway.chat_request import ChatCompletionRequest
from services.gateway.generation import Generator
from services.gateway.reasoning.parser import ReasoningFormat
from services.gateway.responses.answer import (
    RESPONSE_ID_PREFIX, Keeper, ReasoningCounter, ResponsesAnswer, named_event,
)
from services.gateway.responses.background import BackgroundRun, BackgroundRuns
from services.gateway.responses.event_log import EventLog
from services.gateway.responses.conversation import (
    RESPONSES_NAMES, InputError, call_ids, chat_body, check_calls_answered, input_messages,
)
from services.gateway.responses.input_items import listed_items, page
from services.gateway.responses.output import ResponseOutput
from services.gateway.responses.store import ResponseStore, StoredRecord
from services.gateway.responses.request import ResponsesRequest
from shared.tokenizer import Tokenizer

SERVER_UNAVAILABLE = 503
NOTHING_SEEN = -1  # the sequence number before the first event's
TRUE_WORDS, FALSE_WORDS = ("true", "1"), ("false", "0")
DEFAULT_TEMPERATURE = 1.0  # what the response object shows for a parameter the request left out, as OpenAI's does
DEFAULT_TOP_P = 1.0


class ResponsesEndpoint:
    """POST /v1/responses, and the stored responses: GET and DELETE /v1/responses/{response_id}, GET
    /v1/responses/{response_id}/input_items, POST /v1/responses/{response_id}/cancel (a background one)."""

    def __init__(self, generator: Generator, tokenizer: Tokenizer, store: ResponseStore, nc: Client) -> None:
        self._generator = generator
        self._store = store
        self._count_reasoning = reasoning_counter(tokenizer, generator.reasoning_format)
        self.background = BackgroundRuns(nc, store)
        self._events = EventLog(nc, store)

    async def get(self, request: web.Request) -> web.StreamResponse:
        response_id = request.match_info["response_id"]
        stream, after = stream_query(request.query)
        record = (await self._store.get(response_id)).as_read
        if not stream:
            return web.json_response(record.response, dumps=wire_json.dumps_text)
        first = await self._events.first_kept(response_id) if record.response.get("background") else None
        if first is None:
            raise bad_request(f"Response '{response_id}' cannot be streamed: only a response created with background "
                              "true and stream true can, while its events are kept; poll it without stream",
                              param="stream")
        if first > after + 1:
            raise bad_request(f"Response '{response_id}''s events before {first} are no longer kept: stream it "
                              f"starting_after {first - 1} or later, or poll it without stream", param="starting_after")
        return await self._follow(request, response_id, after)

    async def cancel(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        record = await self._store.get(response_id)
        if not record.response.get("background"):
            raise bad_request(f"Response '{response_id}' was not created with background true: only background "
                              "responses can be cancelled")
        record = await self.background.cancel(response_id)
        return web.json_response(record.response, dumps=wire_json.dumps_text)

    async def input_items(self, request: web.Request) -> web.Response:
        record = await self._store.get(request.match_info["response_id"])
        return web.json_response(page(record.items, dict(request.query)), dumps=wire_json.dumps_text)

    async def delete(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        if (await self._store.get(response_id)).response.get("background"):
            await self.background.cancel(response_id)  # a run left going would write its entry back
            await self._events.purge(response_id)
        await self._store.delete(response_id)
        return web.json_response({"id": response_id, "object": "response", "deleted": True})

    async def create(self, request: web.Request) -> web.StreamResponse:
        started = time.monotonic()
        bodies = self._generator.bodies
        try:
            body, data = await bodies.parse_responses(request)
            check_background(body)
            history = [] if body.previous_response_id is None else await self._store.history(body.previous_response_id)
            turn = input_messages(body.input, call_ids(history))
            check_calls_answered(history + turn)
            chat = bodies.chat(chat_body(body, data, history + turn) | self._reasoning_ids())
            writer = ResponsesAnswer(
                shown(body), body.logprobs_count is not None and data.get("include_draft_logprobs") is True,
                self._count_reasoning, self._keeper(turn, listed_items(body.input)) if body.store else None,
            )
            if body.background:
                return await self._start_background(request, chat, started, writer, turn, listed_items(body.input))
            return await self._generator.generate(request, "chat", chat, started, writer)
        except InputError as exc:
            raise bad_request(str(exc), param=exc.param) from exc
        except OpenAIError as exc:
            raise renamed(exc) from exc

    def _reasoning_ids(self) -> dict[str, Any]:
        # The reasoning tokens are counted off the token ids
        return {"return_token_ids": True} if self._generator.reasoning_format is not None else {}

    async def _start_background(
        self, request: web.Request, chat: ChatCompletionRequest, started: float, writer: ResponsesAnswer,
        turn: list[dict[str, Any]], items: list[dict[str, Any]],
    ) -> web.Response:
        """Stores the response `queued`, runs it detached, and answers once it passed every check the foreground
        request would (a bad one is its 4xx, and nothing is stored): with the response object, or streamed, with
        its events as the event log keeps them."""
        response_id = RESPONSE_ID_PREFIX + uuid.uuid4().hex
        queued = ResponseOutput(response_id, int(time.time()), writer.shown, writer.with_draft_logprobs)
        queued.status = "queued"
        writer.output = queued
        events = self._events.writer(response_id) if chat.stream else None
        run = BackgroundRun(self._store, StoredRecord(queued.snapshot(), turn, items), events)

        async def keep(output: ResponseOutput) -> bool:
            return await run.write(output.snapshot(), final=True)

        async def admitted(output: ResponseOutput) -> bool:
            return await run.write(output.snapshot())  # in_progress

        writer.keep, writer.admitted = keep, admitted
        validated = asyncio.Event()

        def on_validated() -> None:
            if events is not None:  # before the run can go on: in order, ahead of what it makes
                writer.events = events.put
                events.put(queued.queued())
            validated.set()

        serving = self._generator.generate(request, "chat", chat, started, writer, validated=on_validated)
        task = self.background.run(run, serving, lambda: queued, validated, renamed)
        checked = asyncio.ensure_future(validated.wait())
        try:
            await asyncio.wait([task, checked], return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the client left before it heard the id: nobody could poll the run
            if not validated.is_set():
                task.cancel()
            raise
        finally:
            checked.cancel()
        if not validated.is_set():
            task.result()  # refused before it ran: its error, as the foreground request would give it
        # Unless it was written meanwhile (admitted, or ended)
        if await run.write(queued.snapshot(), first=True) is False:  # nothing a poll could find: not run
            await self.background.cancel(response_id)
            raise OpenAIError(SERVER_UNAVAILABLE, "The background response could not be kept in the response store "
                              "(its input is over the store's message size, or the store is unreachable); send it "
                              "without background", type=UNAVAILABLE)
        if events is not None:
            return await self._follow(request, response_id, NOTHING_SEEN)
        return web.json_response(run.record.response, dumps=wire_json.dumps_text)

    async def _follow(self, request: web.Request, response_id: str, after: int) -> web.StreamResponse:
        """Streams a background response's events numbered above `after` until its last; a client that leaves
        stops only its own stream (the response runs on)."""
        response = await sse.open_stream(request)
        async with aclosing(self._events.follow(response_id, after)) as followed:  # a client gone: unsubscribed now
            async for events in followed:
                await response.write(b"".join(map(named_event, events)))
        await response.write_eof()
        return response

    def _keeper(self, turn: list[dict[str, Any]], items: list[dict[str, Any]]) -> Keeper:
        async def keep(output: ResponseOutput) -> bool:
            return await self._store.keep(StoredRecord(output.snapshot(), turn, items))
        return keep


def shown(body: ResponsesRequest) -> dict[str, Any]:
    """The request's parameters as its response object shows them, OpenAI's defaults filled in."""
    return {
        "model": body.model,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "max_tool_calls": None,
        "parallel_tool_calls": body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "store": body.store,
        "temperature": DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
        "text": body.text_shown,
        "tool_choice": body.tool_choice_shown,
        "tools": [tool.model_dump() for tool in body.tools or ()],
        "top_p": DEFAULT_TOP_P if body.top_p is None else body.top_p,
        "top_logprobs": body.top_logprobs or 0,
        "truncation": "disabled",
        "user": body.user,
        "metadata": body.metadata or {},
        "background": body.background,
        "service_tier": "default",  # the tier that served it: this server has one
        "safety_identifier": body.safety_identifier,
        "prompt_cache_key": body.prompt_cache_key,
        "prompt_cache_retention": body.prompt_cache_retention,
    }


def check_background(body: ResponsesRequest) -> None:
    """A background response is polled from the store: it needs store."""
    if body.background and not body.store:
        raise bad_request("background responses are polled from the store: background needs store true",
                          param="store")


def stream_query(query: Mapping[str, str]) -> tuple[bool, int]:
    """GET /v1/responses/{id}'s `stream` and `starting_after` (the sequence number of the last event the client
    has; NOTHING_SEEN where it names none): a 400 naming the one that is malformed, or given without stream."""
    stream = query.get("stream", "false").lower()
    if stream not in TRUE_WORDS + FALSE_WORDS:
        raise bad_request(f"stream must be true or false, not {query['stream']!r}", param="stream")
    after = query.get("starting_after")
    if after is None:
        return stream in TRUE_WORDS, NOTHING_SEEN
    if stream not in TRUE_WORDS:
        raise bad_request("starting_after picks where a stream starts: send it with stream=true",
                          param="starting_after")
    if not after.isdigit():
        raise bad_request(f"starting_after must be an event's sequence number (an integer from 0), not {after!r}",
                          param="starting_after")
    return True, int(after)


def renamed(exc: OpenAIError) -> OpenAIError:
    """The error with a chat parameter's name (in `param` and the message) replaced by the Responses API's."""
    param = exc.param
    if param is None:
        return exc
    head, _, rest = param.partition(".")
    if head not in RESPONSES_NAMES:
        return exc
    new = RESPONSES_NAMES[head] + (f".{rest}" if rest else "")
    message = exc.message.replace(param, new).replace(head, RESPONSES_NAMES[head])
    return OpenAIError(exc.status, message, type=exc.type, param=new, code=exc.code, headers=exc.headers)


def reasoning_counter(tokenizer: Tokenizer, reasoning: ReasoningFormat | None) -> ReasoningCounter:
    """Counts an answer's reasoning tokens: those up to the end of its thinking block (the closing tag included), or
    all of them where the block never closes; none in an answer without reasoning."""
    if reasoning is None:
        return lambda token_ids, text: 0
    close_id = reasoning.tag_ids[1]
    close = [close_id] if close_id is not None else tokenizer.encode(reasoning.close_tag, add_special_tokens=False)

    def count(token_ids: list[int], text: str) -> int:
        if not text:
            return 0
        for start in range(len(token_ids) - len(close) + 1):
            if token_ids[start:start + len(close)] == close:
                return start + len(close)
        return len(token_ids)

    return count
