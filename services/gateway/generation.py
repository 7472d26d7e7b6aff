"""The life of one generation request: validate, tokenize, check limits, submit to the mesh, answer.

Each prompt of the request (a completions prompt list may hold several) travels the mesh as a request of its own,
with all n choices, which one worker runs together so they share the prompt's prefill; the response joins them
(choices.py). Submission follows the protocol order: DetokOpen on core NATS first, then the WorkRequest through
JetStream (acknowledged, so a request is either queued durably or refused with a 503). Until its final chunk
arrives a request is live in the mesh, so every way of leaving early (client gone, timeout, lost chunks)
publishes a Cancel that frees the worker slots and the detokenizer state. The answer itself is written by
answer.py.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

import jinja2
import nats.errors
import nats.js.errors
from aiohttp import web
from nats.aio.client import Client
from pydantic import ValidationError

from services.gateway import metrics
from services.gateway.admission import RETRY_AFTER_S, Admission
from shared.prefix_router import PrefixRouter
from services.gateway.aggregate import Api
from services.gateway.answer import answer
from services.gateway.chat_request import ChatCompletionRequest
from services.gateway.choices import ResponseChoices
from services.gateway.completion_request import DEFAULT_COMPLETION_MAX_TOKENS, CompletionRequest
from services.gateway.errors import (
    CONTEXT_LENGTH_EXCEEDED,
    UNAVAILABLE,
    OpenAIError,
    bad_request,
    from_validation_error,
    model_not_found,
)
from services.gateway.options import check_logit_bias, check_min_tokens, check_speculative
from services.gateway.structured_request import compiled, structured_output
from services.gateway.tools.formats import FORMATS, ToolFormat, tool_constraint
from services.gateway.identity import client_identity
from services.gateway.in_flight import Generation
from services.gateway.message_size import check_message_size
from services.gateway.named_logprobs import check_logprob_token_ids
from services.gateway.prompt_size import check_prompt_size, prompt_char_limit
from services.gateway.protocol import DEFAULT_MAX_N
from services.gateway.request_body import RequestBodies
from services.gateway.response_size import check_response_size
from services.gateway.router import ChunkRouter
from services.gateway.truncation import prompt_limit, truncated
from shared import subjects
from shared.request_limits import ModelLimits, OutOfLimits, check_sampling, out_of_vocab
from shared.structured import StructuredOutput
from shared.schemas import Cancel, DetokOpen, DetokReady, SamplingParams, WorkRequest
from shared.seeds import SEED_BITS
from shared.tokenizer import FinalMessageNotFound, Tokenizer

log = logging.getLogger(__name__)

PUBLISH_ACK_TIMEOUT_S = 5.0
DETOK_OPEN_TIMEOUT_S = 5.0
SERVICE_UNAVAILABLE = 503
CLIENT_DISCONNECTED = "client_disconnected"
FAILED = "error"

RETRY_AFTER = {"Retry-After": str(RETRY_AFTER_S)}


class Generator:
    """Serves POST /v1/completions and POST /v1/chat/completions."""

    def __init__(
        self, nc: Client, tokenizer: Tokenizer, router: ChunkRouter, served_model_name: str, max_model_len: int,
        *, server_drafts: int, admission: Admission, keys_checked: bool = False, max_n: int = DEFAULT_MAX_N,
        prefix_router: PrefixRouter | None = None, strict_params: bool = False,
        tool_format: ToolFormat = FORMATS["hermes"],
    ) -> None:
        self._nc = nc
        self._js = nc.jetstream()
        self._tokenizer = tokenizer
        self._router = router
        self._model = served_model_name
        self._max_model_len = max_model_len
        self._server_drafts = server_drafts  # drafts per step the workers are configured for
        self._admission = admission
        self._keys_checked = keys_checked  # whether the Authorization header names a proven client (identity.py)
        self._prompt_char_limit = prompt_char_limit(tokenizer, max_model_len)
        self._prefix_router = prefix_router  # None: every request goes to the shared queue
        self._bodies = RequestBodies(max_n, strict_params)
        self.tool_format = tool_format  # how the model writes tool calls (tools/formats.py)

    async def handle(self, request: web.Request, api: Api) -> web.StreamResponse:
        started = time.monotonic()
        body = await self._bodies.parse(request, api)
        if body.model != self._model:
            raise model_not_found(body.model)
        self._check_stop_token_ids(body)
        check_logit_bias(body, self._tokenizer.vocab_size)
        check_logprob_token_ids(body, self._tokenizer.vocab_size)
        check_speculative(body, self._server_drafts)
        limit = prompt_limit(body, self._max_model_len)
        if limit is None:  # a prompt to be truncated may be as long as the body allows
            check_prompt_size(body, self._prompt_char_limit, self._max_model_len)
        tokenizer = self._tokenizer
        constraint = structured_output(body)
        tool_calls = tool_constraint(body, self.tool_format) if api == "chat" else None
        if tool_calls is not None and constraint is not None:
            raise bad_request(
                f"tool_choice {body.tool_fields.mode!r} makes the answer tool calls; it does not go with another "
                "output constraint (response_format, structured_outputs, guided_*)", param="tool_choice",
            )
        structured = None
        if tool_calls or constraint:
            # A constraint new to this gateway takes up to seconds to compile, in llguidance, which lets the GIL go:
            # on a thread, this gateway's other streams go on meanwhile.
            structured = await asyncio.to_thread(compiled, tool_calls or constraint, tokenizer.model_dir,
                                                 tokenizer.vocab_size, tokenizer.eos_token_ids)
        gens = []
        for prompt_ids in await self._prompts_off_loop(body):
            prompt_ids = truncated(prompt_ids, body, limit)
            max_tokens = self._max_tokens(api, body, len(prompt_ids))
            check_min_tokens(body, max_tokens)
            gens.append(Generation(api, body, prompt_ids, self._sampling(body, max_tokens, structured), started))
        check_response_size(body, [len(g.prompt_ids) for g in gens])
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
                        return await answer(request, gens, choices, chunks, self._model, self.tool_format)
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

    async def _prompts_off_loop(self, body: ChatCompletionRequest | CompletionRequest) -> list[list[int]]:
        """The prompts' token ids, computed on a thread where there is text to render or tokenize (a long one would
        hold up every stream of this gateway). Token ids only need checking: a thread hop would cost such a request
        more than the check (130 us on the 2-core CPU, paid before the request is queued)."""
        if isinstance(body, CompletionRequest) and not any(isinstance(prompt, str) for prompt in body.prompt):
            return self._prompts(body)
        return await asyncio.to_thread(self._prompts, body)

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
                raise bad_request(f"Token id {bad[0]} is out of vocabulary (vocabulary size {vocab})", param=where)
            prompts.append(list(prompt))
        return prompts

    def _chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        try:
            return self._tokenizer.apply_chat_template(
                body.chat(), body.add_generation_prompt, body.continue_final_message, body.template_tools(),
                body.chat_template_kwargs,
            )
        except jinja2.TemplateError as exc:
            raise bad_request(
                f"The chat template cannot render these messages ({type(exc).__name__}: {exc})", param="messages"
            ) from exc
        except FinalMessageNotFound as exc:
            raise bad_request(str(exc), param="continue_final_message") from exc
        except ValueError as exc:  # the model has no chat template
            raise bad_request(str(exc), param="messages") from exc

    def _sampling(
        self, body: ChatCompletionRequest | CompletionRequest, max_tokens: int, structured: StructuredOutput | None
    ) -> SamplingParams:
        """The request's sampling parameters, inside the bounds of the request schema and of the model: what the
        worker checks again, so that a request the gateway queued is never one the worker refuses."""
        try:
            sampling = body.sampling_params(max_tokens, structured)
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
            raise bad_request(out_of_vocab("stop_token_ids", bad, vocab), param="stop_token_ids")

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
            echo_special_tokens=isinstance(gen.body, CompletionRequest) and gen.body.prompt_is_token_ids,
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
            cache_salt=gen.body.cache_salt,
        )
        work_bytes = work.to_bytes()
        check_message_size("work request", work_bytes, self._nc.max_payload, prompt_param)
        if await self._routed(gen, work_bytes):
            return
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

    async def _routed(self, gen: Generation, work_bytes: bytes) -> bool:
        """Sends the request to the worker whose prefix cache holds the longest part of its prompt
        (prefix_router.py); False when it goes to the shared queue instead (no such worker, or the routed stream
        refused it). A request that scores its prompt computes it whole wherever it runs: the shared queue."""
        worker_id = None
        if self._prefix_router is not None and gen.sampling.prompt_logprobs is None:
            worker_id = self._prefix_router.choose(gen.prompt_ids, gen.body.cache_salt, gen.body.num_choices)
        if worker_id is not None:
            try:
                await self._js.publish(
                    subjects.routed(worker_id), work_bytes, timeout=PUBLISH_ACK_TIMEOUT_S, stream=subjects.ROUTED_STREAM
                )
                metrics.ROUTED_REQUESTS.labels(target="worker").inc()
                return True
            except nats.errors.Error as exc:
                log.warning("request %s not routed to worker %d: %r", gen.request_id, worker_id, exc)
        metrics.ROUTED_REQUESTS.labels(target="shared").inc()
        return False

    async def _cancel_all(self, request_ids: list[str], reason: str) -> None:
        for request_id in request_ids:
            await self._cancel(request_id, reason)

    async def _cancel(self, request_id: str, reason: str) -> None:
        try:
            await self._nc.publish(subjects.CANCEL, Cancel(request_id=request_id, reason=reason).to_bytes())
        except nats.errors.Error as exc:
            log.warning("could not cancel request %s (%s): %r", request_id, reason, exc)
