"""Tags in a model's answer that the gateway reads whole, streamed or not: the reasoning block (reasoning/, and
Hermes's tool calls, which are never read inside it; tools/), and how much of a streamed piece may still become a
tag with the next one."""

from __future__ import annotations

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that `tag` starts with (what may become a tag with the next piece)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def opens_with(text: str, tag: str, final: bool, blank: str | None = None) -> bool | None:
    """Whether `text`, its leading `blank` characters (whitespace by default) aside, opens with `tag`; None while
    more of a stream may still tell (all blank, or the start of the tag, and not the `final` piece)."""
    head = text.lstrip(blank)
    if head.startswith(tag):
        return True
    if tag.startswith(head) and not final:
        return None
    return False
