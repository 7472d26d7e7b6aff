"""Applying a grammar's token bitmask to logits: bit t of row r's words says whether token t may come next.

The bitmask is llguidance's layout, [rows, ceil(vocab / 32)] int32 words, bit t % 32 of word t // 32. Disallowed
tokens get -inf, so that softmax, argmax, sampling and verification all read the grammar-masked distribution.
"""

from __future__ import annotations

import torch

BITS = 32
ALL_ALLOWED = -1  # every bit set: the row of a sequence without a grammar


def words_for(vocab_size: int) -> int:
    return (vocab_size + BITS - 1) // BITS


def _byte_bias() -> torch.Tensor:
    """[256, 8]: a bitmask byte's value -> the additive bias of its 8 tokens (0 allowed, -inf forbidden)."""
    bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
    return torch.where(bits.bool(), 0.0, float("-inf"))


BYTE_BIAS = _byte_bias()


def mask_bias(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The bitmask [rows, words] as an additive bias [rows, vocab] (float32): one table lookup per byte, several
    times faster on the CPU than unpacking bits and filling, and one gather on a GPU."""
    table = BYTE_BIAS.to(bitmask.device)
    index = bitmask.contiguous().view(torch.uint8).flatten().to(torch.int32)  # little-endian: word w's byte j
    return table.index_select(0, index).view(bitmask.shape[0], -1)[:, :vocab_size]


def apply_token_mask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """logits [N, vocab] with the tokens bitmask [len(rows), words] forbids at each of `rows` (ascending) set to
    -inf; a new tensor (the raw logits stay what logprobs report)."""
    assert bitmask.dtype == torch.int32 and bitmask.shape[0] == rows.shape[0], (bitmask.shape, rows.shape)
    assert bitmask.shape[1] == words_for(logits.shape[1]), (bitmask.shape, logits.shape)
    bias = mask_bias(bitmask.to(logits.device), logits.shape[1]).to(logits.dtype)
    if rows.shape[0] == logits.shape[0]:  # every row constrained: rows are 0..N-1
        return logits + bias
    return logits.index_add(0, rows, bias)
