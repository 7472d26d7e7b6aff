"""Calls written as JSON objects in a row, `{"name": ..., "<key>": {...}}`: Llama 3 JSON's answer, chained with ";"
(or a python tag, or nothing), and the JSON array (or one object) after Granite's and Mistral's (before v11) calls
tag. One reader serves a whole answer and a stream alike, fed the text as it grows, so that a stream's calls are the
whole answer's whatever the chunking (tool_calls.ToolCallStream).

A call is announced (its name goes out) once its name is the object's first member and the format's arguments key
follows it; its arguments then stream as they are written (arguments.CallArguments). An object laid out otherwise
is a call once it closes with a name and arguments (under either key models use), sent whole. Until the first call
is known the sequence may still be no calls at all (an answer written in JSON, `[]`, a python tag before code):
then all of it is text. After the first call, what breaks the sequence ends it. An announced call whose arguments
are whole keeps them, and what follows them is dropped. One whose arguments stop being JSON (a line break inside a
string, say) or are cut short keeps the arguments as written to the end of the text, compact as far as they read
as JSON (arguments.written_arguments), as a Hermes block does. A next object that is no call is dropped with the
rest of the text. Where the calls end without a break (nothing chains another), the text after them is the
format's to place (Llama 3: content).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto

from services.gateway.tools.arguments import WHITESPACE, CallArguments, CompactJson, unsent, written_arguments
from services.gateway.tools.call import (
    ARGUMENT_KEYS, JSON, NOT_JSON, ParsedCall, call_name, parsed_call,
)

ARRAY_OPEN, ITEM_SEPARATOR = "[", ","
OBJECT_OPEN = "{"


@dataclass(frozen=True)
class SequenceLayout:
    arguments_key: str  # the format's; the one whose value streams
    arrays: bool  # the calls may stand in a JSON array
    separators: tuple[str, ...] = ()  # what chains calls outside an array (Llama 3's ";"); none: one call
    bare_chain: bool = False  # whether an object right after a call (whitespace aside) is the next call


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
    BROKEN = auto()  # an announced call's arguments stopped being JSON: the rest of the text is theirs
    AFTER_ITEM = auto()  # after a call: a separator, the array's close, or the end
    OVER = auto()


class CallSequence:
    """The calls of one answer's text from where they may begin, read as it grows."""

    def __init__(self, layout: SequenceLayout, names: frozenset[str] | None = None) -> None:
        """names: where given, an object naming another function is no call."""
        self.layout = layout
        self.names = names
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
        while self._state not in (_State.OVER, _State.BROKEN) and self._step(events, final):
            pass
        if final and self._state is not _State.OVER:
            if self._state in (_State.OBJECT, _State.BROKEN):
                self._end_object(events, broken=True, final=True)
            else:
                self._end(None)
        return events

    def _step(self, events: list[Opened | Arguments], final: bool) -> bool:
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
        elif self._in_array:
            if char == ITEM_SEPARATOR:
                self._state = _State.ITEM
                self._at += 1
            else:  # the array closed (or broke): what follows is not the answer's
                self._end(None)
        else:
            return self._chain(final)
        return True

    def _chain(self, final: bool) -> bool:
        """After a call outside an array: a separator or (bare_chain) an object chains the next call; else the calls
        are over, and the text after them begins here. False while the text may still become a separator."""
        rest = self.text[self._at :]
        separator = next((s for s in self.layout.separators if rest.startswith(s)), None)
        if separator is not None:
            self._state = _State.ITEM
            self._at += len(separator)
        elif not final and any(s.startswith(rest) for s in self.layout.separators):
            return False
        elif self.layout.bare_chain and rest.startswith(OBJECT_OPEN):
            self._state = _State.ITEM
        else:
            self._end(self._at)
        return True

    def _read_object(self, events: list[Opened | Arguments]) -> bool:
        block = self.text[self._object_at :]
        self._object.feed(self.text[self._at :])
        self._at = len(self.text)
        if self._arguments is None and (named := call_name(block)) is not None and self._callable(named[0]):
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

    def _end_object(self, events: list[Opened | Arguments], broken: bool, final: bool = False) -> None:
        """The open object is over: whole (a call, or not), broken (no JSON from some point), or cut short
        (`final`)."""
        block = self.text[self._object_at : self._at]
        call = None if broken else _call(block, self.layout.arguments_key)
        if call is not None and not self._callable(call.name):
            call = None
        if call is None and self._announced:  # named, its arguments opened: it is a call, with what was written
            if not (self._arguments.whole or final):  # its arguments take the rest of the text, known at the end
                self._state = _State.BROKEN
                return
            call = self._written_call()
        if call is None:  # no call: the sequence is not calls, or is over before this object
            self._at = self._object_at
            self._end(None)
            return
        if not self._announced:
            events.append(Opened(call.name))
        if rest := unsent(call.arguments, self._arguments.sent if self._announced else ""):
            events.append(Arguments(rest))
        self.calls.append(call)
        self._announced = False
        if broken:
            self._end(None)
        else:
            self._state = _State.AFTER_ITEM

    def _written_call(self) -> ParsedCall:
        """An announced call whose object is broken or cut short: its arguments where they are whole (what follows
        them is not theirs), else as written to the end of the text (arguments.written_arguments)."""
        value = self.text[self._object_at + self._arguments.value_at :]
        return ParsedCall(self._arguments.name, written_arguments(value.lstrip(WHITESPACE)))

    def _callable(self, name: str) -> bool:
        return self.names is None or name in self.names

    def _end(self, after: int | None) -> None:
        self._state, self.after = _State.OVER, after
        self.failed = not self.calls


def _call(block: str, arguments_key: str) -> ParsedCall | None:
    """The call a whole object is: a name and arguments, under the format's key or the other one models use; None
    where it is no call, or nested past what Python's json reads or writes."""
    try:
        obj = JSON.decode(block)
        if not isinstance(obj, dict) or not any(key in obj for key in (arguments_key, *ARGUMENT_KEYS)):
            return None
        return parsed_call(obj, arguments_key)
    except NOT_JSON:
        return None
