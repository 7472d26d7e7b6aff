"""Checks of a request's options against what this server serves, which the request models alone cannot know: the
vocabulary (logit_bias), the generation budget (min_tokens) and the server's speculation setting; and bad_words in
the model's tokens."""

from __future__ import annotations

from services.gateway.chat_request import ChatCompletionRequest
from services.gateway.completion_request import CompletionRequest
from services.gateway.errors import bad_request
from shared.request_limits import out_of_vocab
from shared.schemas import MAX_BAD_WORD_TOKENS
from shared.tokenizer import Tokenizer

SPECULATIVE_DRAFTS_PARAM = "speculative.num_speculative_tokens"


def check_logit_bias(body: ChatCompletionRequest | CompletionRequest, vocab_size: int) -> None:
    """Every biased token id must lie inside the vocabulary; those that do not are named."""
    if bad := [token for token in body.logit_bias_ids if token >= vocab_size]:
        raise bad_request(out_of_vocab("logit_bias", bad, vocab_size), param="logit_bias")


def check_allowed_token_ids(
    body: ChatCompletionRequest | CompletionRequest, vocab_size: int, eos_token_ids: frozenset[int],
    bad_words: tuple[tuple[int, ...], ...] = (),
) -> None:
    """The allowed tokens must lie inside the vocabulary, and leave something to generate: not only stop tokens that
    min_tokens forbids, nor only tokens single-token bad words ban (bad_words_token_ids' spellings); a worker lets a
    longer bad word give way where it would leave none."""
    allowed = body.allowed_token_ids
    if allowed is None:
        return
    if bad := sorted({token for token in allowed if not 0 <= token < vocab_size}):
        raise bad_request(out_of_vocab("allowed_token_ids", bad, vocab_size), param="allowed_token_ids")
    held = set()  # the stop tokens, while min_tokens forbids them
    if body.min_tokens:
        held = set(body.stop_token_ids or ()) | (set() if body.ignore_eos else set(eos_token_ids))
    if set(allowed) <= held:
        raise bad_request(
            f"allowed_token_ids holds only stop tokens ({sorted(set(allowed))}), which min_tokens ({body.min_tokens}) "
            "forbids: nothing could be generated", param="allowed_token_ids",
        )
    if set(allowed) <= held | {word[0] for word in bad_words if len(word) == 1}:
        raise bad_request("bad_words ban every token allowed_token_ids allows: nothing could be generated",
                          param="bad_words")


def check_min_tokens(body: ChatCompletionRequest | CompletionRequest, max_tokens: int) -> None:
    """min_tokens must fit in the generation budget (the client's max_tokens, or what the gateway chose)."""
    if body.min_tokens is not None and body.min_tokens > max_tokens:
        requested = body.requested_max_tokens
        budget = f"{requested[0]} ({max_tokens})" if requested else f"the {max_tokens} tokens left for this prompt"
        raise bad_request(f"min_tokens ({body.min_tokens}) must not exceed {budget}", param="min_tokens")


def check_speculative(body: ChatCompletionRequest | CompletionRequest, server_drafts: int) -> None:
    """A request may lower its drafts per step, never raise them above the server's own setting."""
    own = body.speculative.num_speculative_tokens if body.speculative else None
    if own is not None and own > server_drafts:
        raise bad_request(
            f"{SPECULATIVE_DRAFTS_PARAM} is {own}, above this server's {server_drafts} drafts per step; "
            f"ask for 0..{server_drafts}",
            param=SPECULATIVE_DRAFTS_PARAM,
        )


def bad_words_token_ids(words: list[str], tokenizer: Tokenizer) -> tuple[tuple[int, ...], ...]:
    """Each bad word's tokens: the word alone (its leading spaces dropped), and after a space where the tokenizer
    writes a word inside text otherwise, so that the word is banned at the start of the output and inside it. vLLM
    keeps the second spelling only when it has as many tokens as the first, which leaves " return" (one token of a
    byte-level BPE, where "return" alone is two) allowed."""
    spelled: list[tuple[int, ...]] = []
    for word in words:
        alone = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        inside = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if not alone:
            raise bad_request(f"bad_words holds {word!r}, which has no tokens", param="bad_words")
        if max(len(alone), len(inside)) > MAX_BAD_WORD_TOKENS:
            raise bad_request(
                f"bad_words holds {word[:40]!r}..., of {max(len(alone), len(inside))} tokens; at most "
                f"{MAX_BAD_WORD_TOKENS} a word", param="bad_words",
            )
        spelled.append(alone)
        if inside != alone:
            spelled.append(inside)
    return tuple(spelled)

