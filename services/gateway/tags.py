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
