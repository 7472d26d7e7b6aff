"""Logprobs entries of emitted and drafted tokens, and their two OpenAI spellings (chat and completion)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from services.detokenizer.incremental import TokenTable
from shared.frames import NO_TOKEN

MIN_LOGPROB = -9999.0  # OpenAI's stand-in for log(0): JSON has no -inf
TOKEN_ID_PREFIX = "token_id:"  # vLLM's return_tokens_as_token_ids spelling of a token


@dataclass(frozen=True)
class Entry:
    """One token's logprobs, independent of the API that will show it."""

    token_id: int
    logprob: float | None  # None only for an echoed prompt's first token: nothing comes before it
    top: tuple[tuple[int, float], ...] | None  # the request's top-K alternatives, most likely first (None: as above)
    text_offset: int  # where the token's text starts in the choice's text
    accepted: bool | None = None  # drafts only


def _finite(logprob: float) -> float:
    return MIN_LOGPROB if logprob == -math.inf else logprob


def entries(
    token_ids: np.ndarray,  # [n, num_slots]
    logprobs: np.ndarray,  # [n, num_slots]
    top_k: int,
    text_offsets: Sequence[int],
    accepted: Sequence[bool] | None = None,
) -> list[Entry]:
    """Entries for n tokens; a frame may carry more top slots than this request asked for."""
    slots = min(top_k, token_ids.shape[1] - 1) + 1
    ids = token_ids[:, :slots].tolist()
    lps = logprobs[:, :slots].tolist()
    out = []
    for i, (row_ids, row_lps) in enumerate(zip(ids, lps)):
        top = tuple((t, _finite(lp)) for t, lp in zip(row_ids[1:], row_lps[1:]) if t != NO_TOKEN)
        out.append(
            Entry(row_ids[0], _finite(row_lps[0]), top, text_offsets[i], None if accepted is None else accepted[i])
        )
    return out


def _display(table: TokenTable, token_id: int, as_ids: bool) -> tuple[str, list[int]]:
    """(the token's name, its bytes): its text, or "token_id:<id>" when the request asked for ids."""
    text, raw = table.display(token_id)
    return (f"{TOKEN_ID_PREFIX}{token_id}" if as_ids else text), raw


def render(
    api: Literal["chat", "completion"], table: TokenTable, items: Sequence[Entry], draft: bool, as_ids: bool = False
) -> dict:
    """The `logprobs` (or `draft_logprobs`) object of a choice; drafts add whether each was accepted.

    A completions entry's `top_logprobs` always hold its own token, after the alternatives when it is not among
    them (up to `logprobs` + 1 entries), as OpenAI's legacy API and vLLM's completions do: clients look the chosen
    token up there. Chat's hold the alternatives only, as OpenAI's chat does."""
    if api == "chat":
        return {"content": [_chat_entry(table, e, draft, as_ids) for e in items]}
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for e in items:
        tokens.append(_display(table, e.token_id, as_ids)[0])
        token_logprobs.append(e.logprob)
        if e.top is None:
            top_logprobs.append(None)
        else:
            top = {_display(table, t, as_ids)[0]: lp for t, lp in e.top}
            top.setdefault(tokens[-1], e.logprob)
            top_logprobs.append(top)
        text_offset.append(e.text_offset)
    out = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": text_offset}
    if draft:
        out["accepted"] = [bool(e.accepted) for e in items]
    return out


def _chat_entry(table: TokenTable, e: Entry, draft: bool, as_ids: bool) -> dict:
    token, raw = _display(table, e.token_id, as_ids)
    entry = {"token": token, "logprob": e.logprob, "bytes": raw, "top_logprobs": []}
    for t, lp in e.top:
        alt, alt_raw = _display(table, t, as_ids)
        entry["top_logprobs"].append({"token": alt, "logprob": lp, "bytes": alt_raw})
    if draft:
        entry["accepted"] = bool(e.accepted)
    return entry
