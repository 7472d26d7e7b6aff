"""A generation request's answer to its client: its chunks streamed as server-sent events, or kept and joined
into one JSON response, in the OpenAI shape of its endpoint.

Its own module because how the answer is written does not depend on how the request got into the mesh
(generation.py); it reads only the chunks, the request's choices (choices.py) and its Generation (in_flight.py),
and feeds the latency metrics (latency.py).
"""

from __future__ import annotations

import logging

import orjson
from aiohttp import web

from services.gateway import sse
from services.gateway.chat_request import ChatCompletionRequest
from services.gateway.choices import ResponseChoices
from services.gateway.errors import SERVER_ERROR, OpenAIError
from services.gateway.in_flight import Generation
from services.gateway.latency import ResponseLatency
from services.gateway.reasoning.parser import ReasoningFormat, StreamedReasoning, message_with_reasoning
from services.gateway.router import ResponseStream
from services.gateway.structured_request import structured_output
from services.gateway.tools.formats import ToolFormat
from services.gateway.tools.tool_calls import StreamedToolCalls, message_with_calls
from shared.schemas import Usage

log = logging.getLogger(__name__)

INTERNAL_ERROR = 500


async def answer(
    request: web.Request, gens: list[Generation], choices: ResponseChoices, chunks: ResponseStream,
    model: str, tool_format: ToolFormat | None, reasoning_format: ReasoningFormat | None = None,
) -> web.StreamResponse:
    """The request's answer under `model`'s name: server-sent events as its chunks arrive, or one JSON response
    once its last chunk is in. A chat answer has its reasoning set apart in `reasoning_format`, then what follows it
    read for calls in `tool_format` when the request offers tools."""
    body = gens[0].body
    chat = gens[0].api == "chat"
    tools = tool_format if chat and body.tool_fields.parses_calls else None
    reasoning = reasoning_format if chat else None
    if body.stream:
        return await _stream(request, gens, choices, chunks, model, tools, reasoning)
    return await _respond(gens, choices, chunks, model, tools, reasoning)


async def _stream(
    request: web.Request, gens: list[Generation], choices: ResponseChoices, chunks: ResponseStream,
    model: str, tools: ToolFormat | None, reasoning: ReasoningFormat | None,
) -> web.StreamResponse:
    response = await sse.open_stream(request)
    gen = gens[0]  # the body, the api and the envelope are every prompt's
    latency = ResponseLatency(gen.api, gen.started)
    envelope = gen.envelope(model, stream=True)
    include_usage = gen.body.include_usage_in_stream
    every_chunk = gen.body.usage_on_every_chunk  # otherwise chunks carry no usage key at all, as vLLM streams them
    # A request that asked for its speculation summary gets the usage chunk, where the summary is, either way.
    usage_chunk = include_usage or gen.sampling.speculative.return_stats
    ending: list[bytes] = []  # the last chunk's events, or the error: written together with the end
    unsent: list[bytes] = []  # events of chunks that were already waiting (sse.write_caught_up)
    # A completions body has no include_reasoning; it has no reasoning either.
    reader = ChoiceReader(gen.body, tools, reasoning, reasoning is not None and gen.body.include_reasoning)
    try:
        if gen.api == "chat":
            for opening in _chat_openings(gen, choices.num_choices):
                if every_chunk:
                    opening["usage"] = usage_body(choices.running_usage())
                await response.write(sse.event({**envelope, **opening}))
        async for chunk in chunks:
            latency.observe(chunk)
            choices.observe(chunk)
            streamed = choices.streamed(chunk)
            data = {**envelope, "choices": [reader.read(streamed)]}
            if every_chunk:
                data["usage"] = usage_body(choices.running_usage())
            unsent.append(sse.event(data))
            if not chunks.finished:
                await sse.write_caught_up(response, unsent, chunks.has_ready)
                continue
            latency.finished()
            ending += unsent
            unsent.clear()
            if usage_chunk:
                ending.append(sse.event({**envelope, "choices": [], "usage": usage_body(choices.usage())}))
    except OpenAIError as exc:
        ending += [*unsent, sse.event(exc.body())]
    except ConnectionResetError:
        raise
    except Exception:
        log.exception("request %s failed while streaming", gen.request_id)
        ending += [*unsent, sse.event(OpenAIError(INTERNAL_ERROR, "Internal error", type=SERVER_ERROR).body())]
    await sse.close_stream(response, ending)
    return response


def reading(tools: ToolFormat, body: ChatCompletionRequest) -> ToolFormat:
    """The format reading a request's calls; where its answer is constrained beside its tools under `auto` (the
    tools' grammar's `answer`), knowing the functions it may call, as that grammar does."""
    fields = body.tool_fields
    beside_answer = fields.beside_answer(structured_output(body) is not None)
    return tools.reading(fields.functions, [f.name for f in fields.callable] if beside_answer else None)


class ChoiceReader:
    """A streamed chat answer's choices, its reasoning set apart (`reasoning`, with `include` false left out) and
    what follows read for calls in `tools`: each chunk's choice with its delta rewritten."""

    def __init__(
        self, body: ChatCompletionRequest, tools: ToolFormat | None, reasoning: ReasoningFormat | None, include: bool,
    ) -> None:
        self._thinking = None if reasoning is None else StreamedReasoning(reasoning, include)
        self._calls = None
        if tools is not None and body.tool_fields.parses_calls:
            fields = body.tool_fields
            self._calls = StreamedToolCalls(
                reading(tools, body), fields.parallel_tool_calls, fields.forced
            )

    def read(self, choice: dict) -> dict:
        if self._thinking is not None:
            choice = self._thinking.choice(choice)
        return choice if self._calls is None else self._calls.choice(choice)


def _chat_openings(gen: Generation, num_choices: int) -> list[dict]:
    """A chat stream's first chunk of each choice: the assistant role, with the echoed final message (vLLM's
    chat echo); the first also carries the prompt's ids when asked (vLLM's return_token_ids)."""
    body: ChatCompletionRequest = gen.body
    openings = [
        {
            "choices": [
                {
                    "index": index,
                    "delta": {"role": "assistant", "content": body.echoed_text},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ]
        }
        for index in range(num_choices)
    ]
    if body.return_token_ids:
        openings[0]["prompt_token_ids"] = gen.prompt_ids
    return openings


async def _respond(
    gens: list[Generation], choices: ResponseChoices, chunks: ResponseStream, model: str, tools: ToolFormat | None,
    reasoning: ReasoningFormat | None,
) -> web.Response:
    gen = gens[0]  # the body, the api and the envelope are every prompt's
    latency = ResponseLatency(gen.api, gen.started)
    async for chunk in chunks:
        latency.observe(chunk)
        choices.observe(chunk)
        choices.keep(chunk)
    latency.finished()
    merged = choices.merged(
        with_logprobs=gen.sampling.logprobs is not None, with_draft_logprobs=gen.sampling.include_draft_logprobs
    )
    body = {**gen.envelope(model, stream=False), "choices": merged, "usage": usage_body(choices.usage())}
    if gen.api == "chat":
        for choice in merged:
            if reasoning is not None:
                message_with_reasoning(choice["message"], reasoning, gen.body.include_reasoning)
            if tools is not None:
                fields = gen.body.tool_fields
                choice["finish_reason"] = message_with_calls(
                    choice["message"], choice["finish_reason"], reading(tools, gen.body),
                    fields.parallel_tool_calls, fields.forced,
                )
            if gen.body.echoed_text:  # after the calls are read, as a stream's opening chunk is never read for them
                choice["message"]["content"] = gen.body.echoed_text + (choice["message"]["content"] or "")
            prompt_logprobs = choice.pop("prompt_logprobs", None)
        if prompt_logprobs is not None:  # vLLM puts chat's on the response, not the choice
            body["prompt_logprobs"] = prompt_logprobs
        if gen.body.return_token_ids:  # and so the prompt's ids
            body["prompt_token_ids"] = gen.prompt_ids
    return web.json_response(body, dumps=lambda obj: orjson.dumps(obj).decode())


def usage_body(usage: Usage) -> dict:
    """`usage` as a response shows it: `speculative` only for a request that asked for its summary,
    `completion_tokens_details` only for one with a prediction."""
    absent = {"speculative": usage.speculative, "completion_tokens_details": usage.completion_tokens_details}
    return usage.model_dump(exclude={name for name, value in absent.items() if value is None})
