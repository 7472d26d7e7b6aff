"""Turns a request's stream of choices (as the detokenizer sends them) into one non-streaming response.

Text is concatenated, and so is every list inside the logprobs objects: chat `{"content": [...]}` and the
completion arrays `tokens`, `token_logprobs`, `top_logprobs`, `text_offset` (and `accepted` for drafts), and
vLLM's `prompt_logprobs` list.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from shared.schemas import Chunk

Api = Literal["chat", "completion"]
LOGPROB_KEYS = ("logprobs", "draft_logprobs")
# The lists each logprobs object holds even when no token was generated.
EMPTY_LISTS: dict[tuple[Api, str], tuple[str, ...]] = {
    ("chat", "logprobs"): ("content",),
    ("chat", "draft_logprobs"): ("content",),
    ("completion", "logprobs"): ("tokens", "token_logprobs", "top_logprobs", "text_offset"),
    ("completion", "draft_logprobs"): ("tokens", "token_logprobs", "top_logprobs", "text_offset", "accepted"),
}


def _merge_lists(keys: tuple[str, ...], parts: Sequence[dict]) -> dict[str, list]:
    merged: dict[str, list] = {key: [] for key in keys}
    for part in parts:
        for key, values in part.items():
            merged.setdefault(key, []).extend(values)
    return merged


def _text(api: Api, choice: dict) -> str:
    if api == "chat":
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


def merge_choices(
    api: Api, chunks: Sequence[Chunk], with_logprobs: bool, with_draft_logprobs: bool, index: int = 0
) -> dict:
    """One choice in the non-streaming shape; a logprobs object is present exactly when it was requested, and so
    are `token_ids` (vLLM's return_token_ids)."""
    choices = [chunk.choice for chunk in chunks]
    text = "".join(_text(api, choice) for choice in choices)
    finish_reason = next((c["finish_reason"] for c in reversed(choices) if c.get("finish_reason")), None)
    merged: dict = {"index": index}
    if api == "chat":
        merged["message"] = {"role": "assistant", "content": text}
    else:
        merged["text"] = text
    wanted = {"logprobs": with_logprobs, "draft_logprobs": with_draft_logprobs}
    for key in LOGPROB_KEYS:
        parts = [choice[key] for choice in choices if choice.get(key)]
        if wanted[key]:
            merged[key] = _merge_lists(EMPTY_LISTS[api, key], parts)
        elif key == "logprobs":
            merged[key] = None
    merged["finish_reason"] = finish_reason
    # vLLM's: the stop string or stop token id that ended the choice (on its final chunk), else null
    merged["stop_reason"] = next((c["stop_reason"] for c in reversed(choices) if "stop_reason" in c), None)
    if any("token_ids" in choice for choice in choices):
        merged["token_ids"] = [token for choice in choices for token in choice.get("token_ids", ())]
    prompt_parts = [choice["prompt_logprobs"] for choice in choices if "prompt_logprobs" in choice]
    if prompt_parts:  # vLLM's prompt_logprobs, sent in parts before the generated tokens
        merged["prompt_logprobs"] = [entry for part in prompt_parts for entry in part]
    return merged
