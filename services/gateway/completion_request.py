"""The request body of POST /v1/completions, validated: one prompt or a list of them, and echo.

Its own module because only completions take prompt lists, token-id prompts, echo and OpenAI's legacy
`best_of` and `suffix`; what both endpoints share is GenerationRequest (protocol.py).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationInfo, field_validator

from services.gateway.protocol import GenerationRequest, shown
from shared.frames import MAX_TOP_K

DEFAULT_COMPLETION_MAX_TOKENS = 16
MAX_PROMPTS = 2048  # prompts in one completions request (a list), as OpenAI allows


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _refuse_unless_neutral(value: Any, neutral: tuple, what: str) -> Any:
    if value not in neutral:
        raise ValueError(f"{what} is not supported; leave it unset")
    return value


class CompletionRequest(GenerationRequest):
    prompt: Any
    echo: bool | None = False  # before max_tokens, whose check reads it
    add_special_tokens: bool = True  # vLLM extension: a text prompt gets the tokenizer's special tokens (BOS)
    max_tokens: int | None = Field(None, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_K)
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: Any) -> tuple[str | tuple[int, ...], ...]:
        """Normalized to a tuple of prompts, each a string or a tuple of token ids: a string, a list of token ids,
        a list of strings or a list of token-id lists, as OpenAI takes them."""
        if isinstance(value, str):
            return (value,)
        if not isinstance(value, list) or not value:
            raise ValueError(
                "prompt must be a string, a non-empty list of token ids, or a non-empty list of strings or of "
                f"token-id lists, got {shown(value)}"
            )
        if len(value) > MAX_PROMPTS and not all(_is_token_id(t) for t in value):
            raise ValueError(f"at most {MAX_PROMPTS} prompts are allowed in one request, got {len(value)}")
        if all(_is_token_id(t) for t in value):
            return (tuple(value),)
        if all(isinstance(p, str) for p in value):
            return tuple(value)
        if all(isinstance(p, list) for p in value):
            for i, ids in enumerate(value):
                if not ids or not all(_is_token_id(t) for t in ids):
                    raise ValueError(f"prompt[{i}] must be a non-empty list of token ids, got {shown(ids)}")
            return tuple(tuple(ids) for ids in value)
        raise ValueError(
            f"a prompt list must hold only strings or only token-id lists, got {shown(value)}"
        )

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value == 0 and not info.data.get("echo"):
            raise ValueError("max_tokens may be 0 only with echo (the prompt alone comes back)")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, value: int | None, info: ValidationInfo) -> int | None:
        """best_of equal to n asks for nothing more than n; more would need ranking candidates by likelihood."""
        n = info.data.get("n") or 1
        if value is not None and value < n:
            raise ValueError(f"best_of must be at least n ({n}), got {value}")
        if value is not None and value > n:
            raise ValueError(
                f"best_of greater than n is not supported (candidates are not ranked); set it to n ({n}) or leave it "
                f"unset, got {value}"
            )
        return value

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, value: str | None) -> str | None:
        return _refuse_unless_neutral(value or None, (None,), "suffix")

    @property
    def requested_max_tokens(self) -> tuple[str, int] | None:
        return None if self.max_tokens is None else ("max_tokens", self.max_tokens)

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def echoes_prompt(self) -> bool:
        return bool(self.echo)

    @property
    def prompt_is_token_ids(self) -> bool:
        """Whether the prompts came as token ids (a request's prompts are all of one kind)."""
        return isinstance(self.prompt[0], tuple)
