"""An answer whose calls follow an opening, split into content and calls as it grows: Llama 3 JSON (the python tag,
or an object opening with "name"), Granite and Mistral (their calls tag). The same reader reads a whole answer
(`split_calls`) and a stream (tool_calls.ToolCallStream), so the two agree whatever the chunking.

The text before the opening is content, up to where an opening may still be written. From the opening on, the calls'
text is read a piece at a time (Mistral: the text between its tags; the others: all of it) by the format's piece
reader, and a call's name and arguments go out as soon as the reader knows them. Until the first piece reads a
call, what follows the opening is held: if it turns out not to be calls, all of it is text, opening included. After
the calls, Llama 3's text goes on as content; the tagged formats' is not the answer's.
"""

from __future__ import annotations

from enum import Enum, auto
from typing import Protocol

from services.gateway.tags import partial_suffix
from services.gateway.tools.call import ParsedCall, separated
from services.gateway.tools.call_sequence import Arguments, Opened


class PieceReader(Protocol):
    """Reads the calls of one piece of an answer as it grows."""

    failed: bool  # the piece holds no calls

    @property
    def called(self) -> bool: ...

    @property
    def over(self) -> bool: ...

    @property
    def after(self) -> int | None: ...  # where text after the calls begins in the piece, once over

    def feed(self, text: str, final: bool) -> list[Opened | Arguments]: ...


class OpenedFormat(Protocol):
    """What a format whose calls follow an opening tells the reader."""

    piece_tag: str | None  # what separates the pieces of the calls' text (Mistral's calls tag), if anything
    text_after_calls: bool  # whether text after the calls is content
    calls_open_answer: bool  # whether calls only ever open the answer: once text goes out, all of it is text

    def calls_opening(self, text: str) -> tuple[int, int] | None: ...  # (where the opening is, where calls begin)

    def content_until(self, held: str) -> int: ...  # how much of the text so far is content whatever comes

    def piece_reader(self, piece: str) -> PieceReader | None: ...  # None while the piece does not tell which


class _Mode(Enum):
    BEFORE = auto()  # no opening yet
    CALLS = auto()  # from the opening on
    AFTER = auto()  # the calls are over; text after them is content
    DROPPED = auto()  # the calls are over; nothing after them is the answer's
    TEXT = auto()  # the opening is no calls: all is text


class CallsReader:
    def __init__(self, format: OpenedFormat) -> None:
        self.format = format
        self._mode = _Mode.BEFORE
        self._held = ""  # before the opening: text not sent yet
        self._withheld = ""  # from the whitespace before the opening: sent as text if no calls follow
        self._region = ""  # the calls' text from the current piece on
        self._fed = 0  # how much of the current piece its reader was fed
        self._reader: PieceReader | None = None
        self._first_piece = True
        self._last = ""  # the last character of content sent

    def feed(self, text: str, final: bool) -> tuple[str, list[Opened | Arguments]]:
        """(content, what the calls tell) for the next piece of the answer's text; `final`: the answer ends."""
        content, events = [], []
        if self._mode is _Mode.BEFORE:
            text = self._before(text, final, content)
        if self._mode is _Mode.CALLS:
            text = self._calls(text, final, content, events)
        if self._mode is _Mode.AFTER and text:
            content.append(separated(self._last, text) if self._last else text)
            self._last = ""  # only the first text after the calls needs keeping apart
        elif self._mode is _Mode.TEXT:
            content.append(text)
        return "".join(content), events

    def _before(self, text: str, final: bool, content: list[str]) -> str:
        """Content up to the opening; the text after the opening."""
        held = self._held + text
        opening = self.format.calls_opening(held)
        if opening is None:
            cut = len(held) if final else self.format.content_until(held)
            self._held = held[cut:]
            self._send(held[:cut], content)
            if cut and self.format.calls_open_answer:
                self._mode = _Mode.TEXT
                content.append(self._held)
                self._held = ""
            return ""
        start, calls_at = opening
        before = held[:start].rstrip()
        self._send(before, content)
        self._withheld, self._held, self._mode = held[len(before) : calls_at], "", _Mode.CALLS
        return held[calls_at:]

    def _calls(self, text: str, final: bool, content: list[str], events: list[Opened | Arguments]) -> str:
        """Reads the calls' text a piece at a time; the text after the calls (or, where there are none, all of it)."""
        tag = self.format.piece_tag
        self._region += text
        if self._first_piece:
            self._withheld += text
        while True:
            end = self._region.find(tag) if tag is not None else -1
            ended = end >= 0 or final
            readable = end if end >= 0 else len(self._region) - (0 if final or tag is None else
                                                                    partial_suffix(self._region, tag))
            piece = self._region[:readable]
            if self._reader is None:
                self._reader = self.format.piece_reader(piece)
            if self._reader is not None and not self._reader.over:
                events += self._reader.feed(piece[self._fed :], final=ended)
                self._fed = readable
            failed = self._reader.failed if self._reader is not None else ended
            if self._first_piece and failed:  # the opening is no calls: all of it is text
                self._mode = _Mode.TEXT
                return self._withheld
            if self._first_piece and self._reader is not None and self._reader.called:
                self._first_piece, self._withheld = False, ""
            if self._reader is not None and self._reader.over and tag is None:
                after = self._reader.after if self.format.text_after_calls else None
                self._mode = _Mode.DROPPED if after is None else _Mode.AFTER
                return "" if after is None else self._region[after:]
            if end < 0:
                return ""
            self._region, self._fed, self._reader = self._region[end + len(tag) :], 0, None

    def _send(self, text: str, content: list[str]) -> None:
        if text:
            content.append(text)
            self._last = text[-1]


def split_calls(format: OpenedFormat, text: str) -> tuple[str, list[ParsedCall]]:
    """(the text outside the calls, the calls) of a whole answer, as a stream of it reads them."""
    content, events = CallsReader(format).feed(text, final=True)
    calls: list[list[str]] = []
    for event in events:
        if isinstance(event, Opened):
            calls.append([event.name, ""])
        else:
            calls[-1][1] += event.text
    return (content, [ParsedCall(name, arguments) for name, arguments in calls]) if calls else (text, [])
