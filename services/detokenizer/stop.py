"""Finding stop strings in streamed text without ever showing the client part of one.

Text is released as soon as it cannot be the beginning of a stop string. The tail that still could be
(at most max(len(stop)) - 1 characters) is held back until later text settles it. When a stop string
completes, the text before the earliest one is released and everything from it on is dropped.

With vLLM's include_stop_str_in_output the stop string itself is part of the output, so nothing need be held back:
text goes out as it comes, the matcher remembering the last max(len(stop)) - 1 characters it released to find a
stop string that began in them, and the output ends just after the first stop string.

With vLLM's min_tokens, no stop string may end in the text of the first min_tokens tokens (fed with may_stop
false); one that begins there and ends after it does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StopMatch:
    stop: str  # the stop string found: the choice's stop_reason
    start: int  # offset in the whole output where the stop string begins
    end: int  # offset just past the stop string
    included: bool = False  # whether the output keeps the stop string (include_stop_str_in_output)

    @property
    def cut(self) -> int:
        """Where the output ends: before the stop string, or after it when it is included."""
        return self.end if self.included else self.start


@dataclass(frozen=True)
class Released:
    text: str  # text that is now safe to send
    match: StopMatch | None  # set when a stop string was found; no more text follows


class StopMatcher:
    def __init__(self, stops: Sequence[str], include: bool = False) -> None:
        """include: the output keeps the stop string it ends with (include_stop_str_in_output)."""
        # An empty stop string would match before any text; it cannot be what a client meant.
        self._stops = tuple(s for s in stops if s)
        self._include = include
        self._pending = ""  # text received but not released yet
        self._tail = ""  # with include: the last characters released, where a stop string may have begun
        self._tail_len = max(map(len, self._stops), default=1) - 1
        self.released = 0  # characters released so far
        self._floor = 0  # offset in the whole output a stop string must end after (min_tokens' text)

    @property
    def active(self) -> bool:
        """Whether there is any stop string to look for."""
        return bool(self._stops)

    @property
    def holding(self) -> int:
        return len(self._pending)

    def feed(self, text: str, final: bool = False, may_stop: bool = True) -> Released:
        """Adds text; with `final` there is no more to come, so nothing is held back. may_stop false: no stop string
        may end in this text (a token within min_tokens)."""
        if not may_stop:
            self._floor = self.released + len(self._pending) + len(text)
        if self._include:
            return self._feed_included(text)
        pending = self._pending + text
        match = self._earliest(pending, self._floor - self.released)
        if match is not None:
            stop, start = match
            self._pending = ""
            out = pending[:start]
            found = StopMatch(stop, self.released + start, self.released + start + len(stop))
            self.released += len(out)
            return Released(out, found)
        keep = 0 if final else self._forming(pending)
        out = pending[: len(pending) - keep]
        self._pending = pending[len(out) :]
        self.released += len(out)
        return Released(out, None)

    def pass_through(self, text: str) -> Released:
        """Releases what is held and `text` after it, which no stop string may match in or across (a control tag
        kept for the gateway's parser, which the client never sees as text)."""
        out = self._pending + text
        self._pending = self._tail = ""
        self.released += len(out)
        return Released(out, None)

    def _feed_included(self, text: str) -> Released:
        window = self._tail + text
        base = self.released - len(self._tail)  # the window's offset in the whole output
        match = self._earliest(window, self._floor - base)
        if match is not None:
            stop, start = match
            end = start + len(stop)
            out = window[len(self._tail) : end]  # a match ends in the new text: one in the tail alone ended it
            self.released += len(out)
            return Released(out, StopMatch(stop, base + start, base + end, included=True))
        self.released += len(text)
        self._tail = window[-self._tail_len :] if self._tail_len else ""
        return Released(text, None)

    def _earliest(self, text: str, floor: int) -> tuple[str, int] | None:
        """The stop string that matches first, and where, among those ending past `floor` (an offset in text):
        among stops starting at the same place the shortest ends first."""
        best: tuple[str, int] | None = None
        for stop in self._stops:
            at = text.find(stop, max(0, floor - len(stop) + 1))
            if at >= 0 and (best is None or (at, len(stop)) < (best[1], len(best[0]))):
                best = (stop, at)
        return best

    def _forming(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
