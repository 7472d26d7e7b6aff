"""vLLM's `logprob_token_ids`: the logprobs of tokens the client names, at every generated position, in place of
the top alternatives (a classifier reads the scores of its label tokens this way).

Naming tokens turns logprobs on; the endpoint's own count (completions' `logprobs`, chat's `top_logprobs`), when
set, must equal the number of tokens named. The named tokens travel in the frames' top-K slots, so a request names
at most MAX_TOP_K of them (vLLM takes up to 128).
"""

from __future__ import annotations

from services.gateway.chat_request import ChatCompletionRequest
from services.gateway.completion_request import CompletionRequest
from services.gateway.errors import bad_request
from shared.frames import MAX_TOP_K
from shared.request_limits import out_of_vocab

PARAM = "logprob_token_ids"


def check_logprob_token_ids(body: ChatCompletionRequest | CompletionRequest, vocab_size: int) -> None:
    named = body.logprob_token_ids
    if named is None:
        return
    if not named or len(named) > MAX_TOP_K:
        raise bad_request(
            f"{PARAM} must name 1 to {MAX_TOP_K} token ids on this server (the frames carry at most {MAX_TOP_K} "
            f"alternatives per token), got {len(named)}",
            param=PARAM,
        )
    if bad := [token for token in named if not 0 <= token < vocab_size]:
        raise bad_request(out_of_vocab(PARAM, bad, vocab_size), param=PARAM)
    count_param, count = (
        ("top_logprobs", body.top_logprobs) if isinstance(body, ChatCompletionRequest) else ("logprobs", body.logprobs)
    )
    if count is not None and count != len(named):
        raise bad_request(
            f"with {PARAM} set, {count_param} must equal the number of tokens named ({len(named)}) or be left "
            f"unset, got {count}",
            param=PARAM,
        )
