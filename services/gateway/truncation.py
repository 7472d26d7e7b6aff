"""vLLM's `truncate_prompt_tokens` and `truncation_side`: a prompt cut to its last (or first) k tokens after it is
tokenized, so that a client can send a prompt longer than the context and still be answered.

The cut prompt is the prompt as sent to the model: usage counts it, echo shows it, prompt_logprobs score it.
"""

from __future__ import annotations

from services.gateway.chat_request import ChatCompletionRequest
from services.gateway.completion_request import CompletionRequest
from services.gateway.errors import bad_request

WHOLE_CONTEXT = -1  # vLLM's spelling of "as many tokens as the context holds"
PARAM = "truncate_prompt_tokens"


def prompt_limit(body: ChatCompletionRequest | CompletionRequest, max_model_len: int) -> int | None:
    """How many prompt tokens the request keeps; None: it is not truncated. More than the context is refused."""
    k = body.truncate_prompt_tokens
    if k is None:
        return None
    if k == WHOLE_CONTEXT:
        return max_model_len
    if k > max_model_len:
        raise bad_request(
            f"{PARAM} ({k}) is greater than this model's maximum context length ({max_model_len}); "
            f"ask for at most {max_model_len}, or -1 for the whole context",
            param=PARAM,
        )
    return k


def truncated(prompt_ids: list[int], body: ChatCompletionRequest | CompletionRequest, limit: int | None) -> list[int]:
    """The tokens kept: the last `limit` (truncation_side "left", the default, as vLLM's) or the first ("right")."""
    if limit is None or len(prompt_ids) <= limit:
        return prompt_ids
    if body.truncation_side == "right":
        return prompt_ids[:limit]
    return prompt_ids[len(prompt_ids) - limit :]
