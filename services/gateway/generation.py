"""The life of one generation request: validate, tokenize, check limits, submit to the mesh, answer.

Each prompt of the request (a completions prompt list may hold several) travels the mesh as a request of its own,
with all n choices, which one worker runs together so they share the prompt's prefill; the response joins them
(choices.py). The prompts enter the mesh, and are cancelled there, through submission.py; the answer itself is
written by answer.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import jinja2
from aiohttp import web
from nats.aio.client import Client
from pydantic import ValidationError

from services.gateway import metrics
from services.gateway.admission import Admission
from services.gateway.cancelling import to_the_end
from shared.prefix_router import PrefixRouter
from services.gateway.aggregate import Api
from services.gateway.answer import answer
from services.gateway.chat_request import ChatCompletionRequest
from services.gateway.choices import ResponseChoices
from services.gateway.completion_request import DEFAULT_COMPLETION_MAX_TOKENS, CompletionRequest
from services.gateway.errors import (
    CONTEXT_LENGTH_EXCEEDED,
    bad_request,
    from_validation_error,
    model_not_found,
)
from services.gateway.options import (
    bad_words_token_ids, check_allowed_token_ids, check_logit_bias, check_min_tokens, check_speculative,
)
from services.gateway.submission import Submission, Submitter
from services.gateway.prediction import prediction_token_ids
from services.gateway.reasoning.budget import thinking_budget
from services.gateway.reasoning.parser import ReasoningFormat, opening_tag
from services.gateway.structured_request import compiled, holds_free_text, is_structural_tag, structured_output
from services.gateway.tools.formats import FORMAT_NAMES, FORMATS, ToolFormat, tool_constraint
from services.gateway.identity import client_identity
from services.gateway.in_flight import Generation
from services.gateway.named_logprobs import check_logprob_token_ids
from services.gateway.prompt_size import check_prompt_size, prompt_char_limit
from services.gateway.protocol import DEFAULT_MAX_N
from services.gateway.request_body import RequestBodies
from services.gateway.response_size import check_response_size
from services.gateway.router import ChunkRouter, ResponseStream
from services.gateway.truncation import prompt_limit, truncated
from shared.request_limits import ModelLimits, OutOfLimits, check_sampling, out_of_vocab
from shared.structured import StructuredOutput
from shared.schemas import SamplingParams, ThinkingBudget
from shared.seeds import SeedDraw
from shared.tokenizer import FinalMessageNotFound, Tokenizer

CLIENT_DISCONNECTED = "client_disconnected"
# Answers a request's client from its chunks: answer.answer's signature
Writer = Callable[
    [web.Request, list[Generation], ResponseChoices, ResponseStream, str, ToolFormat | None, ReasoningFormat | None],
    Awaitable[web.StreamResponse],
]
FAILED = "error"
# Tokens at the end of a chat prompt read for the reasoning block its template opened or closed (the tags and the
# line breaks after them).
PROMPT_END_TOKENS = 8


class Generator:
    """Serves POST /v1/completions and POST /v1/chat/completions."""

    def __init__(
        self, nc: Client, tokenizer: Tokenizer, router: ChunkRouter, served_model_name: str, max_model_len: int,
        *, server_drafts: int, admission: Admission, keys_checked: bool = False, max_n: int = DEFAULT_MAX_N,
        prefix_router: PrefixRouter | None = None, strict_params: bool = False,
        tool_format: ToolFormat | None = FORMATS["hermes"], reasoning_format: ReasoningFormat | None = None,
        seeds: SeedDraw | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._router = router
        self._model = served_model_name
        self._max_model_len = max_model_len
        self._server_drafts = server_drafts  # drafts per step the workers are configured for
        self._admission = admission
        self._keys_checked = keys_checked  # whether the Authorization header names a proven client (identity.py)
        self._prompt_char_limit = prompt_char_limit(tokenizer, max_model_len)
        self._submitter = Submitter(nc, router.subject, prefix_router)
        self.bodies = RequestBodies(max_n, strict_params)
        self.tool_format = tool_format  # how the model writes tool calls (tools/formats.py); None: not known
        self.reasoning_format = reasoning_format  # how it sets its thinking apart (reasoning/); None: it does not
        self._seeds = seeds or SeedDraw()  # of sampled requests that name none

    async def handle(self, request: web.Request, api: Api) -> web.StreamResponse:
        started = time.monotonic()
        body = await self.bodies.parse(request, api)
        return await self.generate(request, api, body, started)

    async def generate(
        self, request: web.Request, api: Api, body: ChatCompletionRequest | CompletionRequest, started: float,
        writer: Writer = answer, validated: Callable[[], None] | None = None,
    ) -> web.StreamResponse:
        """Serves a validated request (received at monotonic `started`); `writer` answers its client, a chat
        completion's by default (answer.py). `validated` is called once every check passed and the request waits for
        admission (a background response is answered then)."""
        if body.model != self._model:
            raise model_not_found(body.model)
        self._check_stop_token_ids(body)
        check_logit_bias(body, self._tokenizer.vocab_size)
        bad_words = bad_words_token_ids(body.bad_words, self._tokenizer) if body.bad_words else ()
        check_allowed_token_ids(body, self._tokenizer.vocab_size, self._tokenizer.eos_token_ids, bad_words)
        check_logprob_token_ids(body, self._tokenizer.vocab_size)
        check_speculative(body, self._server_drafts)
        limit = prompt_limit(body, self._max_model_len)
        if limit is None:  # a prompt to be truncated may be as long as the body allows
            check_prompt_size(body, self._prompt_char_limit, self._max_model_len)
        tokenizer = self._tokenizer
        constraint = structured_output(body)
        tool_format = self._tool_format(body) if api == "chat" else None
        if api == "chat":
            self._check_include_reasoning(body)
            fields = body.tool_fields
            if body.continue_final_message and (fields.limits_calls or constraint is not None and fields.parses_calls):
                # The final message's text is read for calls with the answer, and no grammar holds it.
                raise bad_request(
                    f"a grammar of the tools ({fields.grammar_param}) does not go with continue_final_message: the "
                    "continued message could call a tool as no grammar allows", param=fields.grammar_param,
                )
        calls_constrained = api == "chat" and body.tool_fields.constrains
        constrained = constraint[0] if constraint else body.tool_fields.grammar_param if calls_constrained else None
        masking = "allowed_token_ids" if body.allowed_token_ids is not None else "bad_words" if body.bad_words else None
        if constrained and masking:
            # Two masks of one position could leave no token at all; a grammar already says what may come.
            raise bad_request(f"{masking} does not go with an output constraint ({constrained})", param=masking)
        structured = None
        prompts = await self._prompts_off_loop(body)
        reasoning = self._reasoning(body, prompts[0]) if api == "chat" else None
        if constraint is not None and reasoning is not None and is_structural_tag(body):
            constraint = structured_output(body, opening_tag(reasoning))  # its text opens no reasoning block
        # The tools' grammar once the reasoning block is known: text it allows must not open as the block does. An
        # answer constrained beside tools under `auto` is that answer or calls; under `required` or a named function
        # it is calls, which hold no content for the answer's constraint to shape (as OpenAI answers the two, an
        # agent's first turn). The answer's own constraint compiles first, so that what does not compile in it is
        # named.
        tool_calls = None
        if api == "chat":
            answer = None
            if constraint is not None and body.tool_fields.parses_calls and body.tool_fields.callable:
                if holds_free_text(body) and body.tool_fields.beside_answer(True):
                    raise bad_request(
                        f"{constraint[0]}: a structural tag, regex or grammar does not go with tools under "
                        "tool_choice \"auto\": the text it allows could write a call's tag, read as a call no "
                        "grammar checked; make the calls part of it (with tool_choice \"none\"), or force them",
                        param=constraint[0],
                    )
                answer = await asyncio.to_thread(compiled, constraint, tokenizer.model_dir, tokenizer.vocab_size,
                                                 tokenizer.eos_token_ids)
            tool_calls = tool_constraint(body, tool_format, opening_tag(reasoning), answer)
        constrained_by = tool_calls or constraint  # (the parameter, its constraint)
        if constrained_by and reasoning is not None:
            # The constraint holds for the answer after the reasoning block, as the reasoning parser sets it apart.
            param, unwrapped = constrained_by
            constrained_by = param, unwrapped.model_copy(
                update={"think_first": reasoning.think_first, "think_tags": reasoning.grammar_tags}
            )
        if constrained_by:
            # A constraint new to this gateway takes up to seconds to compile, in llguidance, which lets the GIL go:
            # on a thread, this gateway's other streams go on meanwhile.
            structured = await asyncio.to_thread(compiled, constrained_by, tokenizer.model_dir,
                                                 tokenizer.vocab_size, tokenizer.eos_token_ids)
        prediction = None
        if api == "chat" and body.prediction is not None:
            prediction = await asyncio.to_thread(
                prediction_token_ids, body.prediction, tokenizer, self._max_model_len
            )
        budget = None
        if body.thinking_token_budget is not None:
            budget = thinking_budget(body.thinking_token_budget, api, reasoning, tokenizer)
        gens = []
        shown_special_ids = self._shown_special_ids(body, reasoning)
        for prompt_ids in prompts:
            prompt_ids = truncated(prompt_ids, body, limit)
            max_tokens = self._max_tokens(api, body, len(prompt_ids))
            check_min_tokens(body, max_tokens)
            sampling = self._sampling(body, max_tokens, structured, prediction, bad_words, budget)
            gens.append(Generation(api, body, prompt_ids, sampling, started, shown_special_ids))
        check_response_size(body, [len(g.prompt_ids) for g in gens])
        choices = ResponseChoices(
            api, [g.request_id for g in gens], [g.prompt_ids for g in gens], body.num_choices, body.return_token_ids
        )
        metrics.IN_FLIGHT.inc()
        try:
            async with self._admission.request(client_identity(request, self._keys_checked)) as places:
                if validated is not None:  # counted against its client's bound: it waits for its places next
                    validated()
                submission = Submission(self._submitter, gens, places)
                with self._router.open(
                    [g.request_id for g in gens], on_final=submission.ended,
                    constraint_param=constrained_by[0] if constrained_by else None,
                ) as chunks:
                    reason = FAILED
                    try:
                        await submission.start(chunks)
                        return await writer(
                            request, gens, choices, chunks, self._model, self.tool_format, reasoning
                        )
                    except (asyncio.CancelledError, ConnectionResetError):
                        reason = CLIENT_DISCONNECTED
                        metrics.CLIENT_DISCONNECTS.inc()
                        raise
                    finally:
                        # Every way out (a client gone while the detokenizer's answer was awaited included) frees
                        # what the mesh still holds, to its end whatever cancellations follow (a background run's
                        # are repeated, cancelling.py): the places go back only once the mesh was told. An
                        # answer given whole holds nothing: no await, where a client closing its connection at once
                        # would cancel a request that succeeded (counted as a disconnect).
                        if submission.holds(chunks.unfinished):
                            await to_the_end(submission.close(chunks.unfinished, reason))
        finally:
            metrics.IN_FLIGHT.dec()

    def _reasoning(self, body: ChatCompletionRequest, prompt_ids: list[int]) -> ReasoningFormat | None:
        """How this chat's answer sets its thinking apart, from the end of its prompt (reasoning/parser.py)."""
        if self.reasoning_format is None:
            return None
        end = self._tokenizer.decode(prompt_ids[-PROMPT_END_TOKENS:], skip_special_tokens=False)
        continued = body.messages[-1].content if body.continue_final_message else None
        return self.reasoning_format.for_chat(end, continued)

    def _check_include_reasoning(self, body: ChatCompletionRequest) -> None:
        if not body.include_reasoning and self.reasoning_format is None:
            raise bad_request(
                "include_reasoning false needs the reasoning set apart from the content: start the server with "
                "--reasoning-parser", param="include_reasoning",
            )

    def _shown_special_ids(
        self, body: ChatCompletionRequest | CompletionRequest, reasoning: ReasoningFormat | None,
    ) -> tuple[int, ...]:
        """The control tokens a chat answer keeps in its text for the gateway to read: a tool-call format's tags
        ([TOOL_CALLS]) when it is read for calls, the reasoning block's ([THINK]) when the answer may hold one (not
        where its prompt held the block whole)."""
        if not isinstance(body, ChatCompletionRequest):
            return ()
        shown = reasoning.shown_special_ids if reasoning is not None and not reasoning.closed else ()
        if self.tool_format is not None and body.tool_fields.parses_calls:
            shown += self.tool_format.shown_special_ids
        return shown

    def _tool_format(self, body: ChatCompletionRequest) -> ToolFormat | None:
        """The format a request's tools are called in; a 400 for a request with tools when the gateway knows none."""
        if self.tool_format is None and body.tool_fields.parses_calls:
            raise bad_request(
                f"This model's chat template does not write tool calls in a format this server reads "
                f"({', '.join(FORMAT_NAMES)}); start the server with --tool-call-parser to name one, or send "
                "tool_choice \"none\"", param="tools",
            )
        return self.tool_format

    async def prompt_token_ids(self, body: ChatCompletionRequest | CompletionRequest) -> list[list[int]]:
        """The token ids of each of the request's prompts, as serving it would compute them (/tokenize)."""
        return await self._prompts_off_loop(body)

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
                prompts.append(self._tokenizer.encode(prompt, add_special_tokens=body.add_special_tokens))
                continue
            if bad := [t for t in prompt if not 0 <= t < vocab]:
                where = "prompt" if len(body.prompt) == 1 else f"prompt.[{i}]"
                raise bad_request(f"Token id {bad[0]} is out of vocabulary (vocabulary size {vocab})", param=where)
            prompts.append(list(prompt))
        return prompts

    def _chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        try:
            return self._tokenizer.apply_chat_template(
                body.chat(self.tool_format), body.add_generation_prompt, body.continue_final_message,
                body.template_tools(),
                body.chat_template_kwargs, body.add_special_tokens,
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
        self, body: ChatCompletionRequest | CompletionRequest, max_tokens: int, structured: StructuredOutput | None,
        prediction: tuple[int, ...] | None = None, bad_words: tuple[tuple[int, ...], ...] = (),
        budget: ThinkingBudget | None = None,
    ) -> SamplingParams:
        """The request's sampling parameters, inside the bounds of the request schema and of the model: what the
        worker checks again, so that a request the gateway queued is never one the worker refuses."""
        try:
            sampling = body.sampling_params(max_tokens, structured, prediction, bad_words, budget)
        except ValidationError as exc:
            raise from_validation_error(exc) from exc
        try:
            check_sampling(sampling, ModelLimits(self._tokenizer.vocab_size, self._max_model_len))
        except OutOfLimits as exc:
            raise bad_request(str(exc), param=exc.param) from exc
        if sampling.seed is None and not sampling.greedy:
            # Fixed here, so that the request draws the same tokens on whichever worker runs it: one that takes it
            # over from a dead worker continues the very output the client has been streamed.
            sampling = sampling.model_copy(update={"seed": self._seeds.draw()})
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
