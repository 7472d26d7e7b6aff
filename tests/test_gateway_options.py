"""Penalties, logit_bias, allowed_token_ids, min_tokens, min_p and per-request speculation at the gateway: every bad
value is a 400 that names the parameter and the value, on both endpoints; a token id outside the vocabulary, a
min_tokens past the budget and more drafts than the server makes are refused by what only the server knows.

A real nats-server, the real gateway app on a real port with a real tokenizer (gatewayfixture.py), and the real
`openai` client. The gateway's speculative config is the default one: 3 drafts per step.
"""

from __future__ import annotations

import openai
import pytest
from tests.gatewayfixture import MODEL, VOCAB_SIZE, client, gateway, model_dir, nats_server

from services.gateway.chat_request import ChatCompletionRequest
from services.gateway.completion_request import CompletionRequest
from services.gateway.options import bad_words_token_ids
from shared.config import SpeculativeConfig
from shared.tokenizer import Tokenizer

__all__ = ["client", "gateway", "model_dir", "nats_server"]  # fixtures, imported for pytest to find

SERVER_DRAFTS = SpeculativeConfig().num_drafts
APIS = ("chat", "completion")

# (extra body, the parameter named, a piece of text the message must hold: the bad value)
BAD = [
    ({"presence_penalty": 2.5}, "presence_penalty", "2.5"),
    ({"presence_penalty": -2.01}, "presence_penalty", "-2.01"),
    ({"frequency_penalty": -3}, "frequency_penalty", "-3"),
    ({"repetition_penalty": 0}, "repetition_penalty", "0"),
    ({"repetition_penalty": -1.5}, "repetition_penalty", "-1.5"),
    ({"min_p": 1.5}, "min_p", "1.5"),
    ({"min_tokens": -1}, "min_tokens", "-1"),
    ({"logit_bias": {"12": 100.5}}, "logit_bias", "100.5"),
    ({"logit_bias": {"abc": 1.0}}, "logit_bias", "abc"),
    ({"logit_bias": {"-4": 1.0}}, "logit_bias", "-4"),
    ({"logit_bias": {str(VOCAB_SIZE): 1.0}}, "logit_bias", str(VOCAB_SIZE)),
    ({"logit_bias": {"3": 1.0, "70000": -1.0}}, "logit_bias", "70000"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens", "9"),
    ({"allowed_token_ids": []}, "allowed_token_ids", None),
    ({"allowed_token_ids": [3, VOCAB_SIZE]}, "allowed_token_ids", str(VOCAB_SIZE)),
    ({"allowed_token_ids": [-1, 3]}, "allowed_token_ids", "-1"),
    # EOS (id 0 here) and a stop token are all it allows, and min_tokens forbids both
    ({"allowed_token_ids": [0, 7], "stop_token_ids": [7], "min_tokens": 1}, "allowed_token_ids", "min_tokens"),
    ({"allowed_token_ids": [3, 4], "response_format": {"type": "json_object"}}, "allowed_token_ids",
     "response_format"),
    ({"bad_words": ["ok", "   "]}, "bad_words", "no tokens"),
    ({"bad_words": ["x" * 200]}, "bad_words", "at most"),
    ({"bad_words": "ok"}, "bad_words", None),
    ({"bad_words": ["x"], "response_format": {"type": "json_object"}}, "bad_words", "response_format"),
    # ids 5 and 6 are "%" and "&" here: the words ban both
    ({"allowed_token_ids": [5, 6], "bad_words": ["%", "&"]}, "bad_words", "every token"),
    ({"thinking_token_budget": -1}, "thinking_token_budget", None),
    # This gateway has no --reasoning-parser (and a completion no reasoning block)
    ({"thinking_token_budget": 3}, "thinking_token_budget", None),
    ({"speculative": {"num_speculative_tokens": SERVER_DRAFTS + 1}}, "speculative.num_speculative_tokens",
     str(SERVER_DRAFTS + 1)),
    ({"speculative": {"num_speculative_tokens": -1}}, "speculative.num_speculative_tokens", "-1"),
    ({"speculative": {"num_spec_tokens": 1}}, "speculative.num_spec_tokens", None),
    ({"speculative": {"return_stats": "yes"}}, "speculative.return_stats", None),
]


async def _error(client: openai.AsyncOpenAI, api: str, extra: dict) -> openai.APIStatusError:
    with pytest.raises(openai.BadRequestError) as info:
        if api == "chat":
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hello"}], extra_body=extra
            )
        else:
            await client.completions.create(model=MODEL, prompt="def f(x):", extra_body=extra)
    return info.value


@pytest.mark.parametrize(("extra", "param", "value"), BAD)
@pytest.mark.parametrize("api", APIS)
async def test_bad_values_are_400s_naming_parameter_and_value(
    client: openai.AsyncOpenAI, api: str, extra: dict, param: str, value: str | None
) -> None:
    exc = await _error(client, api, extra)
    assert exc.status_code == 400 and exc.type == "invalid_request_error"
    assert exc.param == param, exc.body
    if value is not None:
        assert value in exc.body["message"], exc.body


@pytest.mark.parametrize("model", [ChatCompletionRequest, CompletionRequest])
def test_valid_values_reach_the_sampling_params(model) -> None:
    """What the worker gets: the values as sent, defaults where the client left them out."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "prompt": "def"}
    chosen = dict(
        presence_penalty=-2.0, frequency_penalty=2, repetition_penalty=1.7, min_tokens=3, min_p=0.05,
        logit_bias={"17": -100, "4": 0.5}, speculative={"num_speculative_tokens": 0, "return_stats": True},
        allowed_token_ids=[9, 4, 4],
    )
    sampling = model.model_validate({**body, **chosen}).sampling_params(8)
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty) == (-2.0, 2.0, 1.7)
    assert (sampling.min_tokens, sampling.min_p, sampling.logit_bias) == (3, 0.05, {17: -100.0, 4: 0.5})
    assert sampling.speculative.num_speculative_tokens == 0 and sampling.speculative.return_stats
    assert sampling.allowed_token_ids == (4, 9)
    assert sampling.adjusts_logits
    plain = model.model_validate(body).sampling_params(8)
    assert not plain.adjusts_logits and plain.min_p == 0.0 and plain.allowed_token_ids is None
    assert plain.speculative.num_speculative_tokens is None


def test_bad_words_are_spelled_alone_and_inside_text(model_dir) -> None:
    """The word alone, and after a space, also where the two have different numbers of tokens (vLLM would keep
    " return", a single token here, allowed)."""
    tokenizer = Tokenizer(model_dir)
    alone = tuple(tokenizer.encode("return", add_special_tokens=False))
    inside = tuple(tokenizer.encode(" return", add_special_tokens=False))
    assert len(alone) != len(inside)
    assert bad_words_token_ids(["return", " return"], tokenizer) == (alone, inside, alone, inside)
