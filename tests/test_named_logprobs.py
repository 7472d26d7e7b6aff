"""vLLM's logprob_token_ids below the gateway: the worker's named-token slots against log_softmax, and the
sampling parameters that carry them."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from services.worker.sampling.logprobs import token_logprobs_torch, with_named_tokens
from shared.frames import NO_TOKEN
from shared.request_limits import ModelLimits, OutOfLimits, check_sampling
from shared.schemas import SamplingParams

VOCAB = 50
WIDTH = 3  # rows per request, as accept() lays them out


def test_named_tokens_replace_the_top_k_of_their_rows_only() -> None:
    logits = torch.randn(2 * WIDTH, VOCAB, generator=torch.Generator().manual_seed(0))
    chosen = logits.argmax(dim=-1)
    plain = [a.clone() for a in token_logprobs_torch(logits, chosen, 4)]
    ids, values, ranks = with_named_tokens(logits, token_logprobs_torch(logits, chosen, 4), [(slice(3, 6), (7, 2))])
    assert torch.equal(ids[:3], plain[0][:3]) and torch.equal(values[:3], plain[1][:3])  # the other request's rows
    assert torch.equal(ranks, plain[2]) and torch.equal(ids[:, 0], plain[0][:, 0])  # the chosen token untouched
    expected = torch.log_softmax(logits[3:], dim=-1)[:, [7, 2]]
    assert ids[3:, 1:3].tolist() == [[7, 2]] * WIDTH and torch.allclose(values[3:, 1:3], expected)
    assert (ids[3:, 3:] == NO_TOKEN).all() and (values[3:, 3:] == -math.inf).all()


def test_named_tokens_need_a_matching_logprobs_count_and_the_vocabulary() -> None:
    assert SamplingParams(logprobs=2, logprob_token_ids=(3, 4)).logprob_token_ids == (3, 4)
    with pytest.raises(ValidationError, match="must equal the number of logprob_token_ids"):
        SamplingParams(logprobs=1, logprob_token_ids=(3, 4))
    with pytest.raises(OutOfLimits, match="out of vocabulary") as info:
        check_sampling(SamplingParams(logprobs=1, logprob_token_ids=(VOCAB,)), ModelLimits(VOCAB, 64))
    assert info.value.param == "logprob_token_ids"
