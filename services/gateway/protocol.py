"""What the request bodies of POST /v1/completions and POST /v1/chat/completions share, validated: the
sampling, stop conditions and streaming (GenerationRequest); each endpoint's own fields are in
completion_request.py and chat_request.py.

Validation is strict about types (a JSON string is not a number) and names the offending field, so every
bad request becomes a 400 that tells the client which parameter to fix. Fields of the OpenAI API that the
mesh does not implement are accepted only with their neutral value; anything else is refused rather than
silently ignored. Unknown fields are accepted and logged once per name, as vLLM does, or refused under
--strict-params (unknown_fields.py); vLLM extensions these models do not declare are in extensions.py.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from shared.frames import MAX_TOP_K
from shared.structured import StructuredOutput
from shared.seeds import MAX_API_SEED, MIN_API_SEED, worker_seed
from shared.schemas import (
    MAX_BAD_WORDS, MAX_CACHE_SALT_CHARS, MAX_INT32, MAX_LOGIT_BIAS, MAX_PENALTY, NO_PENALTY, NO_REPETITION_PENALTY,
    SamplingParams, SpeculationParams, ThinkingBudget,
)
from services.gateway.structured_request import ResponseFormat, StructuredOutputsOptions, check_backend

MAX_STOP_STRINGS = 16
# A stream holds back as much text as its longest stop string could still match, and every request's stop strings
# travel in its NATS messages: a stop string is bounded like a prompt line, not like a prompt.
MAX_STOP_STRING_CHARS = 1024
TOP_K_OFF = (0, -1)  # vLLM's spellings of "no top-k filtering"
DEFAULT_MAX_N = 16  # the gateway's --max-n
MAX_N_CONTEXT = "max_n"  # the validation context key that carries the gateway's --max-n


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)


class StreamOptions(Body):
    """Unknown keys are refused: a misspelt option (continuous_usage_stat) would otherwise be dropped unseen."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM extension: the usage so far on every chunk
    include_obfuscation: bool | None = None  # OpenAI's padding of chunks against length side channels: none here


class SpeculativeOptions(BaseModel):
    """The request's own `speculative` object (specmesh extension). Unknown keys are refused: a misspelt key that
    was meant to change how the request is served must not be ignored."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    num_speculative_tokens: int | None = None  # at most the server's own; the gateway checks that
    return_stats: bool = False  # usage.speculative: this request's drafted and accepted tokens

    @field_validator("num_speculative_tokens")
    @classmethod
    def _num_drafts(cls, value: int | None) -> int | None:
        if value is not None and value < 0:
            raise ValueError(f"num_speculative_tokens must be at least 0, got {value}")
        return value


SHOWN_VALUE_CHARS = 80  # how much of a bad value an error message quotes


def shown(value: Any) -> str:
    """A bad value as an error message quotes it, cut short."""
    text = repr(value)
    return text if len(text) <= SHOWN_VALUE_CHARS else text[: SHOWN_VALUE_CHARS - 3] + "..."


TEXT_PART = "text"
REFUSAL_PART = "refusal"  # an assistant's refusal ({"type": "refusal", "refusal": "..."}), read as its text


def joined_text_parts(value: Any, refusals: bool = False) -> str:
    """A content field's text: a string, or a list of text parts joined with line breaks, as vLLM joins them (the
    mesh serves text-only models); refusals: an assistant message's, whose parts may be refusals too, as OpenAI's
    schema has them. Anything else is a ValueError saying what is wrong."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError(f"content must be a string or a list of text parts, got {shown(value)}")
    kinds = (TEXT_PART, REFUSAL_PART) if refusals else (TEXT_PART,)
    texts = []
    for i, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds:
            shapes = " or ".join(f'{{"type": "{k}", "{k}": "..."}}' for k in kinds)
            raise ValueError(f"content part [{i}] has type {kind!r}: this model reads text only, as parts {shapes}")
        if not isinstance(part.get(kind), str):
            raise ValueError(f'content part [{i}] of type "{kind}" needs a string "{kind}", got {shown(part)}')
        texts.append(part[kind])
    return "\n".join(texts)


def check_stream_options(value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
    """stream_options only beside stream: true, as OpenAI's API takes it."""
    if value is not None and not info.data.get("stream"):
        raise ValueError("stream_options is only allowed when stream is true")
    return value


class GenerationRequest(Body):
    """What both endpoints share: the model, sampling, stop conditions and streaming.

    Each endpoint adds `requested_max_tokens` ((parameter name, value) of the client's own token budget, or
    None when it left it to the gateway) and `num_logprobs` (top alternatives per token; None: no logprobs).
    """

    model: str
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # vLLM extension
    seed: int | None = Field(None, ge=MIN_API_SEED, le=MAX_API_SEED)  # any int64, as vLLM takes
    stop: Any = ()  # normalized to a tuple of strings
    stop_token_ids: list[int] | None = None  # vLLM extension
    ignore_eos: bool = False  # vLLM extension
    include_stop_str_in_output: bool = False  # vLLM extension: the stop string (or stop token's text) stays
    skip_special_tokens: bool = True  # vLLM extension: false shows generated special tokens' text
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    include_draft_logprobs: bool = False  # specmesh extension, see docs/api.md
    return_token_ids: bool = False  # vLLM extension: prompt_token_ids and each choice's token_ids
    return_tokens_as_token_ids: bool = False  # vLLM extension: logprobs name tokens "token_id:<id>"
    prompt_logprobs: int | None = None  # vLLM extension: top alternatives per prompt token
    logprob_token_ids: list[int] | None = None  # vLLM extension: these tokens' logprobs instead (named_logprobs.py)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM extension
    min_tokens: int | None = None  # vLLM extension
    min_p: float | None = None  # vLLM extension
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias; ids are checked against the vocabulary
    # vLLM extension: generate only these tokens (checked against the vocabulary by the gateway)
    allowed_token_ids: list[int] | None = Field(None, min_length=1)
    # vLLM extension: words never generated (tokenized by the gateway, services/gateway/options.py)
    bad_words: list[Annotated[str, Field(min_length=1)]] | None = Field(None, max_length=MAX_BAD_WORDS)
    # vLLM extension: the reasoning block's most tokens, its closing tag forced after them (reasoning/budget.py)
    thinking_token_budget: int | None = Field(None, ge=0, le=MAX_INT32)
    speculative: SpeculativeOptions | None = None  # specmesh extension
    # vLLM extension: only requests with the same salt share cached prompt blocks (a tenant's own prefix cache)
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    # vLLM extensions: keep only k prompt tokens (-1: as many as the context holds), cut from the left or the right
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    user: str | None = None
    # The output's constraint (structured_request.py): OpenAI's, and vLLM's spellings
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsOptions | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None

    _guided_backend = field_validator("guided_decoding_backend")(check_backend)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> tuple[str, ...]:
        if value is None:
            return ()
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise ValueError("stop must be a string or a list of strings")
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(stops)}")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        if longest := max((len(s) for s in stops if len(s) > MAX_STOP_STRING_CHARS), default=0):
            raise ValueError(f"stop strings may have at most {MAX_STOP_STRING_CHARS} characters, got one of {longest}")
        return tuple(stops)

    @field_validator("n")
    @classmethod
    def _n(cls, value: int | None, info: ValidationInfo) -> int | None:
        max_n = (info.context or {}).get(MAX_N_CONTEXT, DEFAULT_MAX_N)
        if value is not None and not 1 <= value <= max_n:
            raise ValueError(f"n must be between 1 and {max_n} (this server's --max-n), got {value}")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, value: float | None, info: ValidationInfo) -> float | None:
        if value is not None and not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise ValueError(f"{info.field_name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
        return value

    @field_validator("repetition_penalty")
    @classmethod
    def _repetition_penalty(cls, value: float | None) -> float | None:
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise ValueError(f"repetition_penalty must be a finite number greater than 0, got {value}")
        return value

    @field_validator("min_tokens")
    @classmethod
    def _min_tokens(cls, value: int | None) -> int | None:
        if value is not None and value < 0:
            raise ValueError(f"min_tokens must be at least 0, got {value}")
        return value

    @field_validator("min_p")
    @classmethod
    def _min_p(cls, value: float | None) -> float | None:
        if value is not None and not 0.0 <= value <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {value}")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        """Keys must spell token ids; whether each lies inside the vocabulary is the gateway's check."""
        for key, bias in (value or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias} for token {key}"
                )
        return value

    @property
    def logit_bias_ids(self) -> dict[int, float]:
        return {int(key): bias for key, bias in (self.logit_bias or {}).items()}

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is None:
            return value
        if not 0 <= value <= MAX_TOP_K:
            raise ValueError(
                f"prompt_logprobs must be in 0..{MAX_TOP_K} (-1, the whole vocabulary, is not supported), got {value}"
            )
        if value > 0 and info.data.get("stream"):
            raise ValueError("`prompt_logprobs` are not available when `stream=True`.")
        return value

    _stream_options_need_stream = field_validator("stream_options")(check_stream_options)

    @property
    def echoes_prompt(self) -> bool:
        """Whether the prompt's text (and with logprobs its tokens' entries) comes first: completions' echo."""
        return False

    @property
    def echoed_logprobs(self) -> int | None:
        """Top alternatives per echoed prompt token; None: no echoed token has logprobs."""
        return self.logprobs_count if self.echoes_prompt else None

    @property
    def logprobs_count(self) -> int | None:
        """Alternatives per token the response shows: as many as logprob_token_ids names, else the endpoint's own
        count; None: no logprobs."""
        return len(self.logprob_token_ids) if self.logprob_token_ids else self.num_logprobs

    @property
    def shown_prompt_logprobs(self) -> int | None:
        """vLLM's prompt_logprobs as the response shows them: never in a stream (where vLLM accepts only 0)."""
        return None if self.stream else self.prompt_logprobs

    @property
    def shows_prompt(self) -> bool:
        """Whether the response shows the prompt: echoed, or as prompt_logprobs."""
        return self.echoes_prompt or self.shown_prompt_logprobs is not None

    @property
    def prompt_top_k(self) -> int | None:
        """Top alternatives per prompt token that the worker computes; None: the prompt is not scored."""
        return max((k for k in (self.echoed_logprobs, self.shown_prompt_logprobs) if k is not None), default=None)

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def usage_on_every_chunk(self) -> bool:
        """vLLM's continuous_usage_stats, which it honours only beside include_usage."""
        return self.include_usage_in_stream and bool(self.stream_options.continuous_usage_stats)

    @property
    def num_choices(self) -> int:
        """Choices per prompt: `n`."""
        return self.n or 1

    def sampling_params(
        self, max_tokens: int, structured: StructuredOutput | None = None, prediction: tuple[int, ...] | None = None,
        bad_words: tuple[tuple[int, ...], ...] = (), thinking_budget: ThinkingBudget | None = None,
    ) -> SamplingParams:
        """The worker's sampling; `structured`: the request's output constraint, compiled by the gateway;
        `prediction`: the tokens of its predicted output (chat's `prediction`); `bad_words`: the token ids of
        `bad_words`, as the gateway's tokenizer spells them; `thinking_budget`: thinking_token_budget with the
        reasoning block's tags."""
        logprobs = self.logprobs_count
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k in (None, *TOP_K_OFF) else self.top_k,
            seed=None if self.seed is None else worker_seed(self.seed),
            max_tokens=max_tokens,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            logprob_token_ids=tuple(self.logprob_token_ids or ()),
            include_draft_logprobs=self.include_draft_logprobs and logprobs is not None,
            prompt_logprobs=self.prompt_top_k,
            presence_penalty=NO_PENALTY if self.presence_penalty is None else self.presence_penalty,
            frequency_penalty=NO_PENALTY if self.frequency_penalty is None else self.frequency_penalty,
            repetition_penalty=NO_REPETITION_PENALTY if self.repetition_penalty is None else self.repetition_penalty,
            min_tokens=self.min_tokens or 0,
            min_p=self.min_p or 0.0,
            logit_bias=self.logit_bias_ids,
            allowed_token_ids=None if self.allowed_token_ids is None else tuple(sorted(set(self.allowed_token_ids))),
            bad_words_token_ids=bad_words,
            thinking_budget=thinking_budget,
            speculative=SpeculationParams(
                **(self.speculative.model_dump() if self.speculative else {}), prediction_token_ids=prediction
            ),
            structured=structured,
        )
