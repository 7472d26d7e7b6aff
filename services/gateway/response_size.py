"""How many prompt logprobs one response may carry.

What a request generates is bounded by the work it costs the mesh, token by token. What it shows of its prompts is
not: the prompts are scored in their prefill, all at once, and a completions request multiplies them, prompts x n
choices x tokens x (1 + alternatives), each choice echoing and scoring its prompt. A 300 KB body (60 prompts of
1,000 token ids, n 16, echo with 20 logprobs and 20 prompt_logprobs) asked for 40 million values: the gateway grew
to 2.2 GB, and NATS cut it off as a slow consumer, failing every other stream on it. Such a request is refused
before it is queued, naming the parameter that asks for most of it.
"""

from __future__ import annotations

from services.gateway.chat_request import ChatCompletionRequest
from services.gateway.completion_request import CompletionRequest
from services.gateway.errors import bad_request

# Values (a prompt token's logprob, or one alternative's) in one response. lm-eval's scoring of 64 prompts of 2,048
# tokens with 1 alternative asks for 262,144.
MAX_PROMPT_LOGPROBS = 1 << 21


def check_response_size(body: ChatCompletionRequest | CompletionRequest, prompt_lengths: list[int]) -> None:
    """A 400 when the response would show more than MAX_PROMPT_LOGPROBS logprobs of its prompts."""
    n = body.num_choices
    # Completions show prompt_logprobs on every choice; chat once, on the response (answer.py), as vLLM does.
    shown_per_prompt = n if isinstance(body, CompletionRequest) else 1
    asked = {"echo": 0, "prompt_logprobs": 0}
    for prompt_len in prompt_lengths:
        if body.echoed_logprobs is not None:
            asked["echo"] += n * prompt_len * (1 + body.echoed_logprobs)
        if body.shown_prompt_logprobs is not None:
            asked["prompt_logprobs"] += shown_per_prompt * prompt_len * (1 + body.shown_prompt_logprobs)
    total = sum(asked.values())
    if total > MAX_PROMPT_LOGPROBS:
        raise bad_request(
            f"this request's response would show {total:,} logprobs of its prompts (prompt tokens x (1 + "
            f"alternatives), over every prompt and choice), more than {MAX_PROMPT_LOGPROBS:,}: ask for fewer "
            "prompts, choices or alternatives",
            param=max(asked, key=asked.__getitem__),
        )
