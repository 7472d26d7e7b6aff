"""Random walks through a grammar, token by token, as the worker's masks would let a model write: what a tool-call
format's grammar allows, read back by the format."""

from __future__ import annotations

import random

import llguidance
import torch

from shared.tokenizer import Tokenizer


def walk(
    ll: llguidance.LLTokenizer, grammar: str, tokenizer: Tokenizer, rng: random.Random,
    drawn_to: tuple[int, ...] = (), draw: float = 0.5, max_tokens: int | None = None,
) -> tuple[list[int], bool]:
    """(the tokens written, whether the grammar ended): each step a token the grammar allows, one of `drawn_to` (in
    order of preference, each allowed one taken with probability `draw`) or else any; at most `max_tokens`."""
    eos = next(iter(tokenizer.eos_token_ids))
    words = (tokenizer.vocab_size + 31) // 32
    matcher = llguidance.LLMatcher(ll, grammar)
    out: list[int] = []
    while not matcher.is_stopped() and (max_tokens is None or len(out) < max_tokens):
        mask = torch.full((words,), 0, dtype=torch.int32)
        matcher.unsafe_compute_mask_ptr(mask.data_ptr(), words * 4)
        allowed = [t for t in range(tokenizer.vocab_size) if mask[t // 32] >> (t % 32) & 1]
        token = next((t for t in drawn_to if t in allowed and rng.random() < draw), None)
        if token is None:
            token = rng.choice(allowed)
        assert matcher.consume_token(token)
        out.append(token)
    ended = matcher.is_stopped()
    return (out[:-1] if out and out[-1] == eos else out), ended
