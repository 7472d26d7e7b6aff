"""The life of one generation request: validate, tokenize, check limits, submit to the mesh, answer.

Submission follows the protocol order: DetokOpen on core NATS first, then the WorkRequest through
JetStream (acknowledged, so a request is either queued durably or refused with a 503). Until the final
chunk arrives the request is live in the mesh, so every way of leaving early (client gone, timeout, lost
chunks) publishes a Cancel that frees the worker slot and the detokenizer state.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field

import jinja2
import nats.errors
import orjson
from aiohttp import web
from nats.aio.client import Client
from pydantic import ValidationError

from services.gateway import metrics, sse
from services.gateway.aggregate import Api, merge_choices
from services.gateway.errors import (
    CONTEXT_LENGTH_EXCEEDED,
    SERVER_ERROR,
    UNAVAILABLE,
    OpenAIError,
    bad_request,
    from_validation_error,
    model_not_found,
)
from services.gateway.options import check_logit_bias, check_min_tokens, check_speculative
from services.gateway.protocol import DEFAULT_COMPLETION_MAX_TOKENS, ChatCompletionRequest, CompletionRequest
from services.gateway.router import ChunkRouter, ResponseStream
from shared import subjects
from shared.schemas import Cancel, Chunk, DetokOpen, DetokReady, SamplingParams, Usage, WorkRequest
from shared.tokenizer import Tokenizer

log = logging.getLogger(__name__)

PUBLISH_ACK_TIMEOUT_S = 5.0
DETOK_OPEN_TIMEOUT_S = 5.0
SERVICE_UNAVAILABLE = 503
INTERNAL_ERROR = 500
CLIENT_DISCONNECTED = "client_disconnected"
FAILED = "error"

REQUEST_MODELS = {"chat": ChatCompletionRequest, "completion": CompletionRequest}
ID_PREFIX = {"chat": "chatcmpl-", "completion": "cmpl-"}
STREAM_OBJECT = {"chat": "chat.completion.chunk", "completion": "text_completion"}
RESPONSE_OBJECT = {"chat": "chat.completion", "completion": "text_completion"}
ROLE_CHOICE = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}


@dataclass
class Generation:
    """One accepted request on its way through the mesh."""

    api: Api
    body: ChatCompletionRequest | CompletionRequest
    prompt_ids: list[int]
    sampling: SamplingParams
    started: float  # monotonic, for latency metrics
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    saw_first_chunk: bool = False
    last_chunk_at: float = 0.0  # monotonic

    def envelope(self, model: str, stream: bool) -> dict:
        return {
            "id": ID_PREFIX[self.api] + self.request_id,
            "object": (STREAM_OBJECT if stream else RESPONSE_OBJECT)[self.api],
            "created": self.created,
            "model": model,
        }

    def observe(self, chunk: Chunk) -> None:
        now = time.monotonic()
        if not self.saw_first_chunk:
            self.saw_first_chunk = True
            metrics.TIME_TO_FIRST_CHUNK.labels(self.api).observe(now - self.started)
        elif chunk.num_tokens:
            # The histogram counts tokens, so each of the chunk's tokens is one observation of the shared gap.
            per_token = (now - self.last_chunk_at) / chunk.num_tokens
            inter_token = metrics.INTER_TOKEN_LATENCY.labels(self.api)
            for _ in range(chunk.num_tokens):
                inter_token.observe(per_token)
        self.last_chunk_at = now
        if chunk.final and chunk.usage is not None:
            metrics.REQUEST_DURATION.labels(self.api).observe(time.monotonic() - self.started)
            metrics.PROMPT_TOKENS.inc(chunk.usage.prompt_tokens)
            metrics.COMPLETION_TOKENS.inc(chunk.usage.completion_tokens)


class Generator:
    """Serves POST /v1/completions and POST /v1/chat/completions."""

    def __init__(
        self, nc: Client, tokenizer: Tokenizer, router: ChunkRouter, served_model_name: str, max_model_len: int,
        *, server_drafts: int,
    ) -> None:
        self._nc = nc
        self._js = nc.jetstream()
        self._tokenizer = tokenizer
        self._router = router
        self._model = served_model_name
        self._max_model_len = max_model_len
        self._server_drafts = server_drafts  # drafts per step the workers are configured for

    async def handle(self, request: web.Request, api: Api) -> web.StreamResponse:
        started = time.monotonic()
        body = await _parse(request, api)
        if body.model != self._model:
            raise model_not_found(body.model)
        self._check_stop_token_ids(body)
        check_logit_bias(body, self._tokenizer.vocab_size)
        check_speculative(body, self._server_drafts)
        prompt_ids = await asyncio.to_thread(self._prompt_ids, api, body)
        max_tokens = self._max_tokens(api, body, len(prompt_ids))
        check_min_tokens(body, max_tokens)
        sampling = body.sampling_params(max_tokens)
        gen = Generation(api, body, prompt_ids, sampling, started)
        metrics.IN_FLIGHT.inc()
        try:
            with self._router.open(gen.request_id) as chunks:
                await self._submit(gen)
                return await self._answer(request, gen, chunks)
        finally:
            metrics.IN_FLIGHT.dec()

    async def _answer(self, request: web.Request, gen: Generation, chunks: ResponseStream) -> web.StreamResponse:
        reason = FAILED
        try:
            if gen.body.stream:
                return await self._stream(request, gen, chunks)
            return await self._respond(gen, chunks)
        except (asyncio.CancelledError, ConnectionResetError):
            reason = CLIENT_DISCONNECTED
            metrics.CLIENT_DISCONNECTS.inc()
            raise
        finally:
            if not chunks.finished:
                await self._cancel(gen.request_id, reason)

    def _prompt_ids(self, api: Api, body: ChatCompletionRequest | CompletionRequest) -> list[int]:
        if isinstance(body, ChatCompletionRequest):
            try:
                return self._tokenizer.apply_chat_template(body.chat())
            except jinja2.TemplateError as exc:
                raise bad_request(f"The chat template rejected these messages: {exc}", param="messages") from exc
            except ValueError as exc:  # the model has no chat template
                raise bad_request(str(exc), param="messages") from exc
        if isinstance(body.prompt, str):
            return self._tokenizer.encode(body.prompt)
        vocab = self._tokenizer.vocab_size
        if bad := [t for t in body.prompt if not 0 <= t < vocab]:
            raise bad_request(f"Token ids must lie in [0, {vocab}); got {bad[:8]}", param="prompt")
        return list(body.prompt)

    def _check_stop_token_ids(self, body: ChatCompletionRequest | CompletionRequest) -> None:
        vocab = self._tokenizer.vocab_size
        if bad := [t for t in body.stop_token_ids or () if not 0 <= t < vocab]:
            raise bad_request(f"Token ids must lie in [0, {vocab}); got {bad[:8]}", param="stop_token_ids")

    def _max_tokens(self, api: Api, body: ChatCompletionRequest | CompletionRequest, num_prompt: int) -> int:
        """The generation budget; a prompt that leaves no room, or a budget that does not fit, is refused."""
        limit = self._max_model_len
        prompt_param = "messages" if api == "chat" else "prompt"
        if num_prompt == 0:
            raise bad_request("The prompt is empty", param=prompt_param)
        if num_prompt >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens, and the prompt has {num_prompt} tokens, "
                "which leaves no room to generate",
                param=prompt_param,
                code=CONTEXT_LENGTH_EXCEEDED,
            )
        left = limit - num_prompt
        requested = body.requested_max_tokens
        if requested is None:
            # Chat answers may run to the end of the context; completions default to OpenAI's 16 tokens.
            return left if api == "chat" else min(DEFAULT_COMPLETION_MAX_TOKENS, left)
        name, value = requested
        if value > left:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens; the prompt has {num_prompt} tokens and "
                f"{name} is {value}, {num_prompt + value} in total. Lower {name} to at most {left}.",
                param=name,
                code=CONTEXT_LENGTH_EXCEEDED,
            )
        return value

    async def _submit(self, gen: Generation) -> None:
        opening = DetokOpen(
            request_id=gen.request_id,
            reply_subject=self._router.subject,
            api=gen.api,
            stop=gen.body.stop,
            logprobs=gen.sampling.logprobs,
            include_draft_logprobs=gen.sampling.include_draft_logprobs,
            speculative_stats=gen.sampling.speculative.return_stats,
            num_prompt_tokens=len(gen.prompt_ids),
            echo=gen.body.echoes_prompt,
            prompt_logprobs=gen.body.shown_prompt_logprobs,
            prompt_token_ids=tuple(gen.prompt_ids) if gen.body.shows_prompt else (),
        )
        try:
            reply = await self._nc.request(subjects.DETOK_OPEN, opening.to_bytes(), timeout=DETOK_OPEN_TIMEOUT_S)
        except nats.errors.Error as exc:
            raise OpenAIError(
                SERVICE_UNAVAILABLE, f"No detokenizer took the request: {exc!r}", type=UNAVAILABLE
            ) from exc
        work = WorkRequest(
            request_id=gen.request_id,
            prompt_token_ids=tuple(gen.prompt_ids),
            sampling=gen.sampling,
            detok_id=DetokReady.from_bytes(reply.data).detok_id,
            created=time.time(),
        )
        try:
            await self._js.publish(subjects.REQUESTS, work.to_bytes(), timeout=PUBLISH_ACK_TIMEOUT_S)
        except nats.errors.Error as exc:
            await self._cancel(gen.request_id, FAILED)
            raise OpenAIError(
                SERVICE_UNAVAILABLE, f"The request could not be queued: {exc!r}", type=UNAVAILABLE
            ) from exc

    async def _cancel(self, request_id: str, reason: str) -> None:
        try:
            await self._nc.publish(subjects.CANCEL, Cancel(request_id=request_id, reason=reason).to_bytes())
        except nats.errors.Error as exc:
            log.warning("could not cancel request %s (%s): %r", request_id, reason, exc)

    async def _stream(self, request: web.Request, gen: Generation, chunks: ResponseStream) -> web.StreamResponse:
        response = await sse.open_stream(request)
        envelope = gen.envelope(self._model, stream=True)
        include_usage = gen.body.include_usage_in_stream
        if include_usage:
            envelope["usage"] = None
        # A request that asked for its speculation summary gets the usage chunk, where the summary is, either way.
        usage_chunk = include_usage or gen.sampling.speculative.return_stats
        ending: list[bytes] = []  # the last chunk's events, or the error: written together with the end
        try:
            if gen.api == "chat":
                await response.write(sse.event({**envelope, "choices": [ROLE_CHOICE]}))
            async for chunk in chunks:
                gen.observe(chunk)
                event = sse.event({**envelope, "choices": [chunk.choice]})
                if not chunk.final:
                    await response.write(event)
                    continue
                ending.append(event)
                if usage_chunk:
                    ending.append(sse.event({**envelope, "choices": [], "usage": usage_body(chunk.usage)}))
        except OpenAIError as exc:
            ending.append(sse.event(exc.body()))
        except ConnectionResetError:
            raise
        except Exception:
            log.exception("request %s failed while streaming", gen.request_id)
            ending.append(sse.event(OpenAIError(INTERNAL_ERROR, "Internal error", type=SERVER_ERROR).body()))
        await sse.close_stream(response, ending)
        return response

    async def _respond(self, gen: Generation, chunks: ResponseStream) -> web.Response:
        received: list[Chunk] = []
        async for chunk in chunks:
            gen.observe(chunk)
            received.append(chunk)
        choice = merge_choices(
            gen.api,
            received,
            with_logprobs=gen.sampling.logprobs is not None,
            with_draft_logprobs=gen.sampling.include_draft_logprobs,
        )
        body = {
            **gen.envelope(self._model, stream=False),
            "choices": [choice],
            "usage": usage_body(received[-1].usage),
        }
        if gen.api == "chat" and "prompt_logprobs" in choice:  # vLLM puts chat's on the response, not the choice
            body["prompt_logprobs"] = choice.pop("prompt_logprobs")
        return web.json_response(body, dumps=lambda obj: orjson.dumps(obj).decode())


def usage_body(usage: Usage) -> dict:
    """`usage` as a response shows it: `speculative` only for a request that asked for its summary."""
    return usage.model_dump(exclude={"speculative"} if usage.speculative is None else None)


async def _parse(request: web.Request, api: Api) -> ChatCompletionRequest | CompletionRequest:
    raw = await request.read()  # raises 413 past the app's client_max_size
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object")
    try:
        return REQUEST_MODELS[api].model_validate_json(raw)
    except ValidationError as exc:
        raise from_validation_error(exc) from exc
