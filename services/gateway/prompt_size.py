"""Refusing a prompt that cannot fit the context before it is rendered and tokenized.

Tokenizing (and rendering a chat template over) megabytes of text holds the gateway's CPU for seconds. No token
stands for more bytes than the vocabulary's longest, and a character is at least one byte, so a text of more than
`max_model_len x longest token` characters has at least `max_model_len` tokens: more than the context holds even
before any output. Such a prompt is refused from its length alone, with the answer tokenizing would have given.
"""

from __future__ import annotations

from services.gateway.chat_request import ChatCompletionRequest
from services.gateway.completion_request import CompletionRequest
from services.gateway.errors import CONTEXT_LENGTH_EXCEEDED, bad_request
from shared.tokenizer import Tokenizer


def prompt_char_limit(tokenizer: Tokenizer, max_model_len: int) -> int:
    """The most characters a prompt that leaves room to generate can have."""
    longest_token = max(len(piece) for piece in tokenizer.token_bytes)
    return max_model_len * longest_token


def _text_chars(value: object) -> int:
    """Characters of every string in a message (its content, or its content parts' texts)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_text_chars(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(_text_chars(v) for v in value)
    return 0


def check_prompt_size(body: ChatCompletionRequest | CompletionRequest, limit: int, max_model_len: int) -> None:
    """Raises the 400 a prompt longer than `limit` characters would get once tokenized."""
    if isinstance(body, ChatCompletionRequest):
        sizes = [("messages", _text_chars(body.chat()))]
    else:
        many = len(body.prompt) > 1
        sizes = [
            (f"prompt.[{i}]" if many else "prompt", len(prompt))
            for i, prompt in enumerate(body.prompt)
            if isinstance(prompt, str)
        ]
    for param, chars in sizes:
        if chars > limit:
            raise bad_request(
                f"This model's maximum context length is {max_model_len} tokens, and '{param}' has {chars} "
                f"characters, more than {max_model_len} tokens can hold ({limit})",
                param=param,
                code=CONTEXT_LENGTH_EXCEEDED,
            )
