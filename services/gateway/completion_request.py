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
NEUTRAL_BEST_OF = 1
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
    def _best_of(cls, value: int | None) -> int | None:
        return _refuse_unless_neutral(value, (None, NEUTRAL_BEST_OF), f"best_of other than {NEUTRAL_BEST_OF}")

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
