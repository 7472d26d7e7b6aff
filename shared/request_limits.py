"""What a request may ask of the model that serves it: token ids inside its vocabulary, lengths inside its context,
top-k and logprobs no wider than the vocabulary.

The request schema (shared/schemas.py) bounds every value to what the wire and the engine can hold whatever the
model; these checks narrow that to one model. The gateway runs them before it queues a request, and the worker
runs them again on every WorkRequest it takes, against the model it loaded, before any value reaches a tensor or
a frame: the queue takes messages from whoever holds its credentials, and a request handed back by another worker
carries values no gateway looked at.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from shared.schemas import SamplingParams, WorkRequest

SHOWN_BAD_IDS = 8  # how many offending token ids an error message quotes


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int  # token ids lie in [0, vocab_size)
    max_model_len: int  # prompt and generated tokens together

    def __post_init__(self) -> None:
        if self.vocab_size < 1 or self.max_model_len < 1:
            raise ValueError(f"model limits must be positive, got {self}")


class OutOfLimits(ValueError):
    """A request the model cannot serve. `param` names the offending field as the API names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def check_sampling(sampling: SamplingParams, limits: ModelLimits) -> None:
    """The sampling parameters' model-dependent bounds; raises OutOfLimits naming the first one broken."""
    vocab = limits.vocab_size
    if sampling.top_k > vocab:
        raise OutOfLimits("top_k", f"top_k must be at most the vocabulary size {vocab}, got {sampling.top_k}")
    for param, count in (("logprobs", sampling.logprobs), ("prompt_logprobs", sampling.prompt_logprobs)):
        if count is not None and count >= vocab:
            raise OutOfLimits(param, f"{param} must be below the vocabulary size {vocab}, got {count}")
    _check_ids("stop_token_ids", sampling.stop_token_ids, vocab)
    _check_ids("logit_bias", sampling.logit_bias, vocab)
    _check_ids("logprob_token_ids", sampling.logprob_token_ids, vocab)
    _check_ids("allowed_token_ids", sampling.allowed_token_ids or (), vocab)
    _check_ids("bad_words", (t for word in sampling.bad_words_token_ids for t in word), vocab)
    if (budget := sampling.thinking_budget) is not None:
        _check_ids("thinking_token_budget", (budget.open_id, budget.close_id, *budget.layout_ids), vocab)
    _check_ids("prediction", sampling.speculative.prediction_token_ids or (), vocab)


def check_work_request(request: WorkRequest, limits: ModelLimits) -> None:
    """Everything a worker must know before it admits a request: its sampling, its prompt and every resumed choice
    inside the model's vocabulary, and room in the context for at least one more token of each choice (generation
    stops at the context length whatever max_tokens says). Raises OutOfLimits naming the first field that is not."""
    check_sampling(request.sampling, limits)
    _check_ids("prompt", request.prompt_token_ids, limits.vocab_size)
    for choice in request.choices():
        _check_ids("progress", choice.output_token_ids, limits.vocab_size)
        num_tokens = len(request.prompt_token_ids) + len(choice.output_token_ids)
        if num_tokens >= limits.max_model_len:
            raise OutOfLimits(
                "prompt", f"choice {choice.index} holds {num_tokens} tokens, which leave no room in the context "
                f"(max_model_len {limits.max_model_len})",
            )
        if choice.output_token_ids and len(choice.output_token_ids) >= request.sampling.max_tokens:
            raise OutOfLimits(
                "progress", f"choice {choice.index} already has {len(choice.output_token_ids)} tokens, "
                f"max_tokens is {request.sampling.max_tokens}",
            )


def out_of_vocab(param: str, bad: list[int], vocab_size: int) -> str:
    """The message for token ids outside the vocabulary, worded as vLLM words it, so that clients read one kind."""
    return f"token id(s) {bad[:SHOWN_BAD_IDS]} in {param} are out of vocabulary (vocabulary size {vocab_size})"


def _check_ids(param: str, ids: Iterable[int], vocab_size: int) -> None:
    if bad := [t for t in ids if not 0 <= t < vocab_size]:
        raise OutOfLimits(param, out_of_vocab(param, bad, vocab_size))
