"""How a response's prompts enter the mesh and leave it: each takes its places from admission (admission.py), then
is published in the protocol order, and every prompt still live when the response ends is cancelled.

Submission follows the protocol order: DetokOpen on core NATS first, then the WorkRequest through JetStream
(acknowledged, so a prompt is either queued durably or refused with a 503). Until its final chunk arrives a prompt
is live in the mesh, so every way of leaving early (client gone, timeout, lost chunks) publishes a Cancel that
frees the worker slots and the detokenizer state.

A request of many prompts enters a prompt at a time, in its client's turns: its first prompt before the answer
starts (a wait for room, or a refusal, comes before anything is written), the others on a task of their own while
the answer streams, each giving its places back when its final chunk arrives. So a batch of thousands of prompts
shares the mesh with other clients instead of holding it until it ends.
"""

from __future__ import annotations

import asyncio
import logging
import time

import nats.errors
import nats.js.errors
from nats.aio.client import Client

from services.gateway import metrics
from services.gateway.admission import RETRY_AFTER, Places
from services.gateway.cancelling import cancel_until_done
from services.gateway.completion_request import CompletionRequest
from services.gateway.errors import SERVER_ERROR, UNAVAILABLE, OpenAIError
from services.gateway.in_flight import Generation
from services.gateway.message_size import check_message_size
from services.gateway.router import ResponseStream
from shared import subjects
from shared.prefix_router import PrefixRouter
from shared.schemas import Cancel, DetokOpen, DetokReady, WorkRequest

log = logging.getLogger(__name__)

PUBLISH_ACK_TIMEOUT_S = 5.0
DETOK_OPEN_TIMEOUT_S = 5.0
SERVICE_UNAVAILABLE = 503
INTERNAL_ERROR = 500


class Submitter:
    """Publishes one prompt into the mesh, or cancels it there."""

    def __init__(self, nc: Client, reply_subject: str, prefix_router: PrefixRouter | None) -> None:
        self._nc = nc
        self._js = nc.jetstream()
        self._reply_subject = reply_subject  # where this gateway's chunks arrive (router.py)
        self._prefix_router = prefix_router  # None: every prompt goes to the shared queue

    async def submit(self, gen: Generation) -> None:
        opening = DetokOpen(
            request_id=gen.request_id,
            reply_subject=self._reply_subject,
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
            prediction_token_ids=gen.sampling.speculative.prediction_token_ids,
            shown_special_ids=gen.shown_special_ids,
            include_stop_str_in_output=gen.body.include_stop_str_in_output,
            skip_special_tokens=gen.body.skip_special_tokens,
            min_tokens=gen.sampling.min_tokens,
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
        """Sends the prompt to the worker whose prefix cache holds the longest part of it (prefix_router.py); False
        when it goes to the shared queue instead (no such worker, or the routed stream refused it). A prompt to be
        scored is computed whole wherever it runs: the shared queue."""
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

    async def cancel(self, request_ids: list[str], reason: str) -> None:
        for request_id in request_ids:
            try:
                await self._nc.publish(subjects.CANCEL, Cancel(request_id=request_id, reason=reason).to_bytes())
            except nats.errors.Error as exc:
                log.warning("could not cancel request %s (%s): %r", request_id, reason, exc)


class Submission:
    """One response's prompts on their way into the mesh, each in its client's turn."""

    def __init__(self, submitter: Submitter, gens: list[Generation], places: Places) -> None:
        self._submitter = submitter
        self._gens = gens
        self._places = places
        self._weight = gens[0].body.num_choices  # places each prompt holds: its n choices
        self._holding: set[str] = set()  # the prompts holding their places, until their final chunk
        self._rest: asyncio.Task[None] | None = None

    async def start(self, chunks: ResponseStream) -> None:
        """Submits the first prompt, waiting for its turn; the others follow on a task of their own, and a failure
        there reaches the answer through `chunks`."""
        await self._enter(self._gens[0], chunks)
        if len(self._gens) > 1:
            self._rest = asyncio.create_task(self._enter_rest(chunks))

    def ended(self, request_id: str) -> None:
        """A prompt's final chunk arrived: its places go to whoever waits for them."""
        if request_id in self._holding:
            self._holding.remove(request_id)
            self._places.give_back(self._weight)

    def holds(self, unfinished: list[str]) -> bool:
        """Whether closing has anything to do: prompts still to submit, or submitted and not finished."""
        submitting = self._rest is not None and not self._rest.done()
        return submitting or bool(self._opened(unfinished))

    async def close(self, unfinished: list[str], reason: str) -> None:
        """Stops submitting, and cancels the prompts the mesh may still hold (of `unfinished`, those opened)."""
        if self._rest is not None:
            await cancel_until_done(self._rest)
        await self._submitter.cancel(self._opened(unfinished), reason)

    def _opened(self, unfinished: list[str]) -> list[str]:
        """Those of the `unfinished` prompts a detokenizer may hold: their DetokOpen went out."""
        live = set(unfinished)
        return [g.request_id for g in self._gens if g.opened and g.request_id in live]

    async def _enter(self, gen: Generation, chunks: ResponseStream) -> None:
        await self._places.take(self._weight)
        self._holding.add(gen.request_id)
        await self._submitter.submit(gen)
        chunks.liveness.owned_by(gen.request_id, gen.detok_id)

    async def _enter_rest(self, chunks: ResponseStream) -> None:
        try:
            for gen in self._gens[1:]:
                await self._enter(gen, chunks)
        except OpenAIError as exc:
            chunks.fail(exc)
        except Exception:
            log.exception("request %s: submitting its prompts failed", self._gens[0].request_id)
            chunks.fail(OpenAIError(INTERNAL_ERROR, "Internal error", type=SERVER_ERROR))
