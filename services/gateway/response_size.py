"""How many logprobs one response may carry.

A completions request multiplies: prompts x n choices x tokens (each prompt echoed or scored once per choice, each
choice's generated tokens) x (1 + alternatives). A 300 KB body (60 prompts of 1,000 token ids, n 16, echo with 20
logprobs and 20 prompt_logprobs) asks for 40 million values: the gateway that aggregates them grew to 2.2 GB, and
NATS cut it off as a slow consumer, failing every other stream on it. Such a request is refused before it is
queued, naming the parameter that asks for most of it.
"""

from __future__ import annotations

from services.gateway.chat_request import ChatCompletionRequest
from services.gateway.completion_request import CompletionRequest
from services.gateway.errors import bad_request

# Values (a token's logprob, or one alternative's) in one response. lm-eval's scoring of 64 prompts of 2,048 tokens
# asks for 262,144; 16 choices of 2,048 tokens with 20 alternatives each for 688,128.
MAX_RESPONSE_LOGPROBS = 1 << 21


def check_response_size(
    body: ChatCompletionRequest | CompletionRequest, prompt_lengths: list[int], max_tokens: list[int]
) -> None:
    """A 400 when the response would carry more than MAX_RESPONSE_LOGPROBS logprobs, at most (each choice running
    to its max_tokens)."""
    n = body.num_choices
    asked = {"logprobs": 0, "prompt_logprobs": 0}
    for prompt_len, budget in zip(prompt_lengths, max_tokens):
        if body.logprobs_count is not None:
            asked["logprobs"] += n * budget * (1 + body.logprobs_count)
        if body.echoed_logprobs is not None:
            asked["logprobs"] += n * prompt_len * (1 + body.echoed_logprobs)
        if body.shown_prompt_logprobs is not None:
            asked["prompt_logprobs"] += n * prompt_len * (1 + body.shown_prompt_logprobs)
    total = sum(asked.values())
    if total > MAX_RESPONSE_LOGPROBS:
        raise bad_request(
            f"this request's response could carry {total:,} logprobs (tokens x (1 + alternatives), over every prompt "
            f"and choice), more than {MAX_RESPONSE_LOGPROBS:,}: ask for fewer prompts, choices, tokens or "
            "alternatives",
            param=max(asked, key=asked.__getitem__),
        )
