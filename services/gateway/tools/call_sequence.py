"""Calls written as JSON objects in a row, `{"name": ..., "<key>": {...}}`: Llama 3 JSON's answer, chained with ";",
and the JSON array (or one object) after Granite's and Mistral's (before v11) calls tag. One reader serves a whole
answer and a stream alike, fed the text as it grows, so that a stream's calls are the whole answer's whatever the
chunking (tool_calls.ToolCallStream).

A call is announced (its name goes out) once its name is the object's first member and the format's arguments key
follows it; its arguments then stream as they are written (arguments.CallArguments). An object laid out otherwise
is a call once it closes with a name and arguments (under either key models use), sent whole. Until the first call
is known the sequence may still be no calls at all (an answer written in JSON, `[]`, a python tag before code):
then all of it is text. After the first call, what breaks the sequence ends it: a call cut short or malformed keeps
its name and the arguments written (as a Hermes block does), and a next object that is no call is dropped with the
rest of the text. Where the calls end without a break (no separator follows), the text after them is the format's to
place (Llama 3: content).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto

from services.gateway.tools.arguments import WHITESPACE, CallArguments, CompactJson, partial_arguments
from services.gateway.tools.call import (
    ARGUMENT_KEYS, JSON, NOT_JSON, ParsedCall, call_name, json_text, parsed_call,
)

ARRAY_OPEN, ITEM_SEPARATOR = "[", ","
OBJECT_OPEN = "{"


@dataclass(frozen=True)
class SequenceLayout:
    arguments_key: str  # the format's; the one whose value streams
    separator: str | None  # between calls outside an array (Llama 3's ";"); None: one call outside an array
    arrays: bool  # the calls may stand in a JSON array


@dataclass(frozen=True)
class Opened:
    """A call's name is known: it goes out, with its index."""

    name: str


@dataclass(frozen=True)
class Arguments:
    """More of the open call's arguments."""

    text: str


class _State(Enum):
    START = auto()  # before the first call (or the array holding it)
    ITEM = auto()  # where a call's object opens: after `[`, a separator
    OBJECT = auto()  # inside a call's object
    AFTER_ITEM = auto()  # after a call: a separator, the array's close, or the end
    OVER = auto()


class CallSequence:
    """The calls of one answer's text from where they may begin, read as it grows."""

    def __init__(self, layout: SequenceLayout) -> None:
        self.layout = layout
        self.text = ""
        self.calls: list[ParsedCall] = []
        self.failed = False  # the text is no calls: all of it is text
        self.after: int | None = None  # where text after the calls begins, once over (None: there is none)
        self._state = _State.START
        self._in_array = False
        self._at = 0  # where reading goes on
        self._object_at = 0  # where the open object begins
        self._object: CompactJson | None = None
        self._arguments: CallArguments | None = None  # the open object's, once its name is its first member
        self._announced = False

    @property
    def over(self) -> bool:
        return self._state is _State.OVER

    @property
    def called(self) -> bool:
        """Whether a call was announced or read: the text is calls."""
        return bool(self.calls) or self._announced

    def feed(self, text: str, final: bool) -> list[Opened | Arguments]:
        """What the next piece of text tells of the calls; with `final`, the text is whole and the sequence is over
        (failed, where no call was read)."""
        self.text += text
        events: list[Opened | Arguments] = []
        while self._state is not _State.OVER and self._step(events):
            pass
        if final and self._state is not _State.OVER:
            if self._state is _State.OBJECT:
                self._end_object(events, broken=True)
            else:
                self._end(None)
        return events

    def _step(self, events: list[Opened | Arguments]) -> bool:
        """Reads on from `_at`; False where more text is needed."""
        if self._state is _State.OBJECT:
            return self._read_object(events)
        while self._at < len(self.text) and self.text[self._at] in WHITESPACE:
            self._at += 1
        if self._at == len(self.text):
            return False
        char = self.text[self._at]
        if self._state is _State.START and self.layout.arrays and char == ARRAY_OPEN:
            self._in_array, self._state = True, _State.ITEM
            self._at += 1
        elif self._state in (_State.START, _State.ITEM):
            if char == OBJECT_OPEN:
                self._object_at, self._state = self._at, _State.OBJECT
                self._object, self._arguments, self._announced = CompactJson(), None, False
            else:
                self._end(None)  # `[]`, `[1]`, or a separator after which no call stands
        elif char == (ITEM_SEPARATOR if self._in_array else self.layout.separator):
            self._state = _State.ITEM
            self._at += 1
        else:
            # The array closed, or the chain ended without a separator: in an array what follows is not the answer's
            self._end(None if self._in_array else self._at)
        return True

    def _read_object(self, events: list[Opened | Arguments]) -> bool:
        block = self.text[self._object_at :]
        self._object.feed(self.text[self._at :])
        self._at = len(self.text)
        if self._arguments is None and (named := call_name(block)) is not None:
            name, after_name = named
            self._arguments = CallArguments(name, after_name, self.layout.arguments_key)
        if self._arguments is not None:
            streamed = self._arguments.read(block)
            if not self._announced and self._arguments.value_at is not None:
                self._announced = True
                events.append(Opened(self._arguments.name))
            if streamed:
                events.append(Arguments(streamed))
        if self._object.whole:
            self._at = self._object_at + self._object.settled
            self._end_object(events, broken=False)
            return True
        if self._object.invalid:
            self._end_object(events, broken=True)
            return True
        return False

    def _end_object(self, events: list[Opened | Arguments], broken: bool) -> None:
        """The open object is over: whole (a call, or not), broken (no JSON from some point), or cut short."""
        block = self.text[self._object_at : self._at]
        call = None if broken else _call(block, self.layout.arguments_key)
        if call is None and self._announced:  # named, its arguments opened: it is a call, with what was written
            call = self._written_call(block)
        if call is None:  # no call: the sequence is not calls, or is over before this object
            self._at = self._object_at
            self._end(None)
            return
        if not self._announced:
            events.append(Opened(call.name))
        sent = self._arguments.sent if self._announced else ""
        if not call.arguments.startswith(sent):
            raise AssertionError(f"streamed arguments {sent!r} are not the start of the call's {call.arguments!r}")
        if call.arguments[len(sent) :]:
            events.append(Arguments(call.arguments[len(sent) :]))
        self.calls.append(call)
        self._announced = False
        if broken:
            self._end(None)
        else:
            self._state = _State.AFTER_ITEM

    def _written_call(self, block: str) -> ParsedCall:
        """An announced call whose object is cut short or broken: its arguments whole where they were written whole,
        else what was written of them up to the break (arguments.partial_arguments)."""
        value = self.text[self._object_at + self._arguments.value_at :].lstrip(WHITESPACE)
        try:
            arguments = json_text(JSON.raw_decode(value)[0])
        except NOT_JSON:
            arguments = partial_arguments(value, to_break=True)
        return ParsedCall(self._arguments.name, arguments)

    def _end(self, after: int | None) -> None:
        self._state, self.after = _State.OVER, after
        self.failed = not self.calls


def _call(block: str, arguments_key: str) -> ParsedCall | None:
    """The call a whole object is: a name and arguments, under the format's key or the other one models use."""
    try:
        obj = JSON.decode(block)
    except NOT_JSON:  # nested past the recursion limit
        return None
    if not isinstance(obj, dict) or not any(key in obj for key in (arguments_key, *ARGUMENT_KEYS)):
        return None
    return parsed_call(obj, arguments_key)
