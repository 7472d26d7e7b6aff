"""The life of one generation request: validate, tokenize, check limits, submit to the mesh, answer.

Each prompt of the request (a completions prompt list may hold several) travels the mesh as a request of its own,
with all n choices, which one worker runs together so they share the prompt's prefill; the response joins them
(choices.py). Submission follows the protocol order: DetokOpen on core NATS first, then the WorkRequest through
JetStream (acknowledged, so a request is either queued durably or refused with a 503). Until its final chunk
arrives a request is live in the mesh, so every way of leaving early (client gone, timeout, lost chunks)
publishes a Cancel that frees the worker slots and the detokenizer state.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from dataclasses import dataclass, field

import jinja2
import nats.errors
import nats.js.errors
import orjson
from aiohttp import web
from nats.aio.client import Client
from pydantic import ValidationError

from services.gateway import metrics, sse
from services.gateway.admission import RETRY_AFTER_S, Admission
from services.gateway.aggregate import Api
from services.gateway.choices import ResponseChoices
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
from services.gateway.protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS, DEFAULT_MAX_N, MAX_N_CONTEXT, ChatCompletionRequest, CompletionRequest,
)
from services.gateway.identity import client_identity
from services.gateway.message_size import check_message_size
from services.gateway.prompt_size import check_prompt_size, prompt_char_limit
from services.gateway.router import ChunkRouter, ResponseStream
from shared import subjects
from shared.request_limits import ModelLimits, OutOfLimits, check_sampling
from shared.schemas import Cancel, Chunk, DetokOpen, DetokReady, SamplingParams, Usage, WorkRequest
from shared.seeds import SEED_BITS
from shared.tokenizer import FinalMessageNotFound, Tokenizer

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
RETRY_AFTER = {"Retry-After": str(RETRY_AFTER_S)}
NO_CACHED_TOKENS = 0  # usage.prompt_tokens_details.cached_tokens: the mesh keeps no prompt cache between requests


@dataclass
class Generation:
    """One accepted prompt on its way through the mesh, with its n choices."""

    api: Api
    body: ChatCompletionRequest | CompletionRequest
    prompt_ids: list[int]
    sampling: SamplingParams
    started: float  # monotonic, for latency metrics
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    opened: bool = False  # its DetokOpen went out: from then on a detokenizer may hold it, and must be told to let go
    detok_id: str = ""  # the detokenizer that took it
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
        *, server_drafts: int, admission: Admission, keys_checked: bool = False, max_n: int = DEFAULT_MAX_N,
    ) -> None:
        self._nc = nc
        self._js = nc.jetstream()
        self._tokenizer = tokenizer
        self._router = router
        self._model = served_model_name
        self._max_model_len = max_model_len
        self._server_drafts = server_drafts  # drafts per step the workers are configured for
        self._max_n = max_n
        self._admission = admission
        self._keys_checked = keys_checked  # whether the Authorization header names a proven client (identity.py)
        self._prompt_char_limit = prompt_char_limit(tokenizer, max_model_len)

    async def handle(self, request: web.Request, api: Api) -> web.StreamResponse:
        started = time.monotonic()
        body = await _parse(request, api, self._max_n)
        if body.model != self._model:
            raise model_not_found(body.model)
        self._check_stop_token_ids(body)
        check_logit_bias(body, self._tokenizer.vocab_size)
        check_speculative(body, self._server_drafts)
        check_prompt_size(body, self._prompt_char_limit, self._max_model_len)
        gens = []
        for prompt_ids in await asyncio.to_thread(self._prompts, body):
            max_tokens = self._max_tokens(api, body, len(prompt_ids))
            check_min_tokens(body, max_tokens)
            gens.append(Generation(api, body, prompt_ids, self._sampling(body, max_tokens), started))
        choices = ResponseChoices(
            api, [g.request_id for g in gens], [g.prompt_ids for g in gens], body.num_choices, body.return_token_ids
        )
        metrics.IN_FLIGHT.inc()
        try:
            identity = client_identity(request, self._keys_checked)
            async with self._admission.admit(identity, len(gens) * body.num_choices):
                with self._router.open([g.request_id for g in gens]) as chunks:
                    reason = FAILED
                    try:
                        await self._submit_all(gens)
                        for gen in gens:
                            chunks.liveness.owned_by(gen.request_id, gen.detok_id)
                        return await self._answer(request, gens, choices, chunks)
                    except (asyncio.CancelledError, ConnectionResetError):
                        reason = CLIENT_DISCONNECTED
                        metrics.CLIENT_DISCONNECTS.inc()
                        raise
                    finally:
                        # Every way out (a client gone while the detokenizer's answer was awaited included) frees
                        # what the mesh still holds; shielded, so a second cancellation cannot cut it short.
                        live = set(chunks.unfinished)
                        held = [g.request_id for g in gens if g.opened and g.request_id in live]
                        await asyncio.shield(self._cancel_all(held, reason))
        finally:
            metrics.IN_FLIGHT.dec()

    async def _answer(
        self, request: web.Request, gens: list[Generation], choices: ResponseChoices, chunks: ResponseStream
    ) -> web.StreamResponse:
        if gens[0].body.stream:
            return await self._stream(request, gens, choices, chunks)
        return await self._respond(gens, choices, chunks)

    def _prompts(self, body: ChatCompletionRequest | CompletionRequest) -> list[list[int]]:
        """The token ids of each prompt: a chat's one rendered conversation, or each prompt of a completion."""
        if isinstance(body, ChatCompletionRequest):
            return [self._chat_prompt(body)]
        vocab = self._tokenizer.vocab_size
        prompts = []
        for i, prompt in enumerate(body.prompt):
            if isinstance(prompt, str):
                prompts.append(self._tokenizer.encode(prompt))
                continue
            if bad := [t for t in prompt if not 0 <= t < vocab]:
                where = "prompt" if len(body.prompt) == 1 else f"prompt.[{i}]"
                raise bad_request(f"Token ids of '{where}' must lie in [0, {vocab}); got {bad[:8]}", param=where)
            prompts.append(list(prompt))
        return prompts

    def _chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        try:
            return self._tokenizer.apply_chat_template(
                body.chat(), body.add_generation_prompt, body.continue_final_message
            )
        except jinja2.TemplateError as exc:
            raise bad_request(
                f"The chat template cannot render these messages ({type(exc).__name__}: {exc})", param="messages"
            ) from exc
        except FinalMessageNotFound as exc:
            raise bad_request(str(exc), param="continue_final_message") from exc
        except ValueError as exc:  # the model has no chat template
            raise bad_request(str(exc), param="messages") from exc

    def _sampling(self, body: ChatCompletionRequest | CompletionRequest, max_tokens: int) -> SamplingParams:
        """The request's sampling parameters, inside the bounds of the request schema and of the model: what the
        worker checks again, so that a request the gateway queued is never one the worker refuses."""
        try:
            sampling = body.sampling_params(max_tokens)
        except ValidationError as exc:
            raise from_validation_error(exc) from exc
        try:
            check_sampling(sampling, ModelLimits(self._tokenizer.vocab_size, self._max_model_len))
        except OutOfLimits as exc:
            raise bad_request(str(exc), param=exc.param) from exc
        if sampling.seed is None and not sampling.greedy:
            # Fixed here, so that the request draws the same tokens on whichever worker runs it: one that takes it
            # over from a dead worker continues the very output the client has been streamed.
            sampling = sampling.model_copy(update={"seed": secrets.randbits(SEED_BITS)})
        return sampling

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

    async def _submit_all(self, gens: list[Generation]) -> None:
        """Submits every prompt's request; when one cannot be, handle() cancels those already opened."""
        for gen in gens:
            await self._submit(gen)

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
            n=gen.body.num_choices,
            return_token_ids=gen.body.return_token_ids,
            tokens_as_token_ids=gen.body.return_tokens_as_token_ids,
            echo=gen.body.echoes_prompt,
            prompt_logprobs=gen.body.shown_prompt_logprobs,
            prompt_token_ids=tuple(gen.prompt_ids) if gen.body.shows_prompt else (),
        )
        prompt_param = "messages" if gen.api == "chat" else "prompt"
        opening_bytes = opening.to_bytes()
        check_message_size("detokenizer opening", opening_bytes, self._nc.max_payload, prompt_param)
        gen.opened = True
        try:
            reply = await self._nc.request(subjects.DETOK_OPEN, opening_bytes, timeout=DETOK_OPEN_TIMEOUT_S)
        except nats.errors.Error as exc:
            raise OpenAIError(
                SERVICE_UNAVAILABLE, f"No detokenizer took the request: {exc!r}", type=UNAVAILABLE,
                headers=RETRY_AFTER,
            ) from exc
        gen.detok_id = DetokReady.from_bytes(reply.data).detok_id
        work = WorkRequest(
            request_id=gen.request_id,
            prompt_token_ids=tuple(gen.prompt_ids),
            n=gen.body.num_choices,
            sampling=gen.sampling,
            detok_id=gen.detok_id,
            created=time.time(),
        )
        work_bytes = work.to_bytes()
        check_message_size("work request", work_bytes, self._nc.max_payload, prompt_param)
        try:
            await self._js.publish(subjects.REQUESTS, work_bytes, timeout=PUBLISH_ACK_TIMEOUT_S)
        except nats.js.errors.APIError as exc:  # the stream refused it: a limit of the work queue is reached
            raise OpenAIError(
                SERVICE_UNAVAILABLE, f"The work queue is full ({exc.description}); retry later", type=UNAVAILABLE,
                headers=RETRY_AFTER,
            ) from exc
        except nats.errors.Error as exc:
            raise OpenAIError(
                SERVICE_UNAVAILABLE, f"The request could not be queued: {exc!r}", type=UNAVAILABLE,
                headers=RETRY_AFTER,
            ) from exc

    async def _cancel_all(self, request_ids: list[str], reason: str) -> None:
        for request_id in request_ids:
            await self._cancel(request_id, reason)

    async def _cancel(self, request_id: str, reason: str) -> None:
        try:
            await self._nc.publish(subjects.CANCEL, Cancel(request_id=request_id, reason=reason).to_bytes())
        except nats.errors.Error as exc:
            log.warning("could not cancel request %s (%s): %r", request_id, reason, exc)

    async def _stream(
        self, request: web.Request, gens: list[Generation], choices: ResponseChoices, chunks: ResponseStream
    ) -> web.StreamResponse:
        response = await sse.open_stream(request)
        gen = gens[0]  # the body, the api and the envelope are every prompt's
        by_request = {g.request_id: g for g in gens}
        envelope = gen.envelope(self._model, stream=True)
        include_usage = gen.body.include_usage_in_stream
        every_chunk = gen.body.usage_on_every_chunk
        if include_usage or every_chunk:
            envelope["usage"] = None
        # A request that asked for its speculation summary gets the usage chunk, where the summary is, either way.
        usage_chunk = include_usage or gen.sampling.speculative.return_stats
        ending: list[bytes] = []  # the last chunk's events, or the error: written together with the end
        try:
            if gen.api == "chat":
                for opening in self._chat_openings(gen, choices.num_choices):
                    if every_chunk:
                        opening["usage"] = usage_body(choices.running_usage())
                    await response.write(sse.event({**envelope, **opening}))
            async for chunk in chunks:
                by_request[chunk.request_id].observe(chunk)
                choices.observe(chunk)
                data = {**envelope, "choices": [choices.streamed(chunk)]}
                if every_chunk:
                    data["usage"] = usage_body(choices.running_usage())
                event = sse.event(data)
                if not chunks.finished:
                    await response.write(event)
                    continue
                ending.append(event)
                if usage_chunk:
                    ending.append(sse.event({**envelope, "choices": [], "usage": usage_body(choices.usage())}))
        except OpenAIError as exc:
            ending.append(sse.event(exc.body()))
        except ConnectionResetError:
            raise
        except Exception:
            log.exception("request %s failed while streaming", gen.request_id)
            ending.append(sse.event(OpenAIError(INTERNAL_ERROR, "Internal error", type=SERVER_ERROR).body()))
        await sse.close_stream(response, ending)
        return response

    @staticmethod
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
        self, gens: list[Generation], choices: ResponseChoices, chunks: ResponseStream
    ) -> web.Response:
        gen = gens[0]  # the body, the api and the envelope are every prompt's
        by_request = {g.request_id: g for g in gens}
        async for chunk in chunks:
            by_request[chunk.request_id].observe(chunk)
            choices.observe(chunk)
            choices.keep(chunk)
        merged = choices.merged(
            with_logprobs=gen.sampling.logprobs is not None, with_draft_logprobs=gen.sampling.include_draft_logprobs
        )
        body = {**gen.envelope(self._model, stream=False), "choices": merged, "usage": usage_body(choices.usage())}
        if gen.api == "chat":
            for choice in merged:
                choice["message"]["content"] = gen.body.echoed_text + choice["message"]["content"]
                prompt_logprobs = choice.pop("prompt_logprobs", None)
            if prompt_logprobs is not None:  # vLLM puts chat's on the response, not the choice
                body["prompt_logprobs"] = prompt_logprobs
            if gen.body.return_token_ids:  # and so the prompt's ids
                body["prompt_token_ids"] = gen.prompt_ids
        return web.json_response(body, dumps=lambda obj: orjson.dumps(obj).decode())


def usage_body(usage: Usage) -> dict:
    """`usage` as a response shows it: `speculative` only for a request that asked for its summary, and OpenAI's
    `prompt_tokens_details`."""
    body = usage.model_dump(exclude={"speculative"} if usage.speculative is None else None)
    body["prompt_tokens_details"] = {"cached_tokens": NO_CACHED_TOKENS}
    return body


async def _parse(request: web.Request, api: Api, max_n: int) -> ChatCompletionRequest | CompletionRequest:
    raw = await request.read()  # raises 413 past the app's client_max_size
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object")
    try:
        return REQUEST_MODELS[api].model_validate_json(raw, context={MAX_N_CONTEXT: max_n})
    except ValidationError as exc:
        raise from_validation_error(exc) from exc
