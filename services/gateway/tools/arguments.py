"""A call's arguments as they stream: the JSON text the model writes, made compact a piece at a time, exactly as the
whole answer's arguments are (tools/call.json_text: no whitespace between tokens, strings re-escaped as Python's
json writes them without ensure_ascii, numbers and literals as they read back), so that a stream's argument deltas
add up to the whole answer's arguments whatever the chunking.

Output is only ever added to: a number or literal goes out once a delimiter ends it, an escape once it is whole, a
high surrogate once the next escape tells whether it pairs. Text that is no JSON stops the output where it starts;
the whole answer's arguments are then the compact text so far and the rest as written (`written_arguments`), which
the stream's output is a prefix of, as it is of a value cut short (max_tokens).
"""

from __future__ import annotations

import json
from enum import Enum, auto

WHITESPACE = " \t\n\r"
SCALAR_CHARS = frozenset("0123456789+-.eEabcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
UNICODE_ESCAPE_DIGITS = 4
HEX_DIGITS = frozenset("0123456789abcdefABCDEF")
HIGH_SURROGATES = range(0xD800, 0xDC00)
LOW_SURROGATES = range(0xDC00, 0xE000)
SURROGATES = range(HIGH_SURROGATES.start, LOW_SURROGATES.stop)
_ENCODE = json.encoder.py_encode_basestring  # how json.dumps(ensure_ascii=False) writes a string, quotes included


def escaped_surrogate(char: str) -> str:
    """A lone surrogate as the JSON escape it was written as (json.dumps would write it raw, and no UTF-8 holds it)."""
    return f"\\u{ord(char):04x}"


class _Expect(Enum):
    VALUE = auto()  # a value (at the start, after a colon, after a comma in an array)
    VALUE_OR_CLOSE = auto()  # just after `[`
    KEY = auto()  # a key (after a comma in an object)
    KEY_OR_CLOSE = auto()  # just after `{`
    COLON = auto()
    COMMA_OR_CLOSE = auto()  # after a value inside a container
    STRING = auto()  # inside a string
    ESCAPE = auto()  # after a backslash in a string
    SCALAR = auto()  # inside a number or literal
    END = auto()  # the value is whole
    INVALID = auto()  # the text is no JSON from `settled` on


class CompactJson:
    """One JSON value's text, read a piece at a time, written compact."""

    def __init__(self) -> None:
        self._expect = _Expect.VALUE
        self._containers: list[str] = []  # the open `{` and `[`
        self._pending = ""  # a number or literal, not written yet
        self._in_key = False  # the string being read is a key
        self._escape = ""  # an escape being read, from its backslash
        self._high: int | None = None  # a high surrogate's code, written once what follows it is known
        self._read = 0  # characters fed so far
        self.settled = 0  # characters whose output is written (the rest is pending, skipped, or no JSON)

    @property
    def whole(self) -> bool:
        return self._expect is _Expect.END

    @property
    def invalid(self) -> bool:
        return self._expect is _Expect.INVALID

    def feed(self, text: str) -> str:
        """The compact output of the next piece of text; nothing once the value is whole or the text no JSON."""
        out: list[str] = []
        for char in text:
            if self._expect is _Expect.SCALAR and char not in SCALAR_CHARS:  # the delimiter ends the scalar
                if self._end_scalar(out):
                    self.settled = self._read
                else:
                    self._expect = _Expect.INVALID
            if self._expect in (_Expect.END, _Expect.INVALID):
                break
            self._read += 1
            skipped = char in WHITESPACE and self._expect not in (_Expect.STRING, _Expect.ESCAPE)
            if not self._take(char, out):
                self._expect = _Expect.INVALID
                break
            # Whitespace between tokens stays with the text after it: text that is no JSON keeps it apart from the
            # token before (`1 2` never reads as 12)
            if not (skipped or self._pending or self._escape or self._high is not None):
                self.settled = self._read
        return "".join(out)

    def _take(self, char: str, out: list[str]) -> bool:
        """Reads one character; False where the text stops being JSON."""
        expect = self._expect
        if expect is _Expect.STRING:
            return self._string_char(char, out)
        if expect is _Expect.ESCAPE:
            return self._escape_char(char, out)
        if expect is _Expect.SCALAR:
            self._pending += char
            return True
        if char in WHITESPACE:
            return True
        if expect is _Expect.COLON:
            return self._punctuation(char == ":", ":", _Expect.VALUE, out)
        if expect is _Expect.COMMA_OR_CLOSE:
            if char == ",":
                after = _Expect.KEY if self._containers[-1] == "{" else _Expect.VALUE
                return self._punctuation(True, ",", after, out)
            return self._close(char, out)
        if expect in (_Expect.KEY, _Expect.KEY_OR_CLOSE):
            if char == '"':
                return self._open_string(out, key=True)
            return expect is _Expect.KEY_OR_CLOSE and self._close(char, out)
        if expect is _Expect.VALUE_OR_CLOSE and char == "]":
            return self._close(char, out)
        return self._value_start(char, out)

    def _value_start(self, char: str, out: list[str]) -> bool:
        if char in "{[":
            self._containers.append(char)
            out.append(char)
            self._expect = _Expect.KEY_OR_CLOSE if char == "{" else _Expect.VALUE_OR_CLOSE
            return True
        if char == '"':
            return self._open_string(out, key=False)
        if char in SCALAR_CHARS:
            self._pending, self._expect = char, _Expect.SCALAR
            return True
        return False

    def _punctuation(self, allowed: bool, char: str, after: _Expect, out: list[str]) -> bool:
        if allowed:
            out.append(char)
            self._expect = after
        return allowed

    def _close(self, char: str, out: list[str]) -> bool:
        if not self._containers or char != {"{": "}", "[": "]"}[self._containers[-1]]:
            return False
        self._containers.pop()
        out.append(char)
        self._value_done()
        return True

    def _value_done(self) -> None:
        self._expect = _Expect.COMMA_OR_CLOSE if self._containers else _Expect.END

    def _open_string(self, out: list[str], key: bool) -> bool:
        self._in_key = key
        out.append('"')
        self._expect = _Expect.STRING
        return True

    def _string_char(self, char: str, out: list[str]) -> bool:
        if char == "\\":
            self._escape, self._expect = char, _Expect.ESCAPE
            return True
        self._release_high(out)  # a high surrogate no escape follows stands alone
        if char == '"':
            out.append('"')
            if self._in_key:
                self._expect = _Expect.COLON
            else:
                self._value_done()
            return True
        if ord(char) < 0x20:  # a control character must be escaped inside a JSON string
            return False
        self._write(char, out)
        return True

    def _escape_char(self, char: str, out: list[str]) -> bool:
        """Inside an escape: `\\x`, or `\\uXXXX` a digit at a time; a high surrogate waits for its pair."""
        self._escape += char
        if len(self._escape) == 2:
            if char == "u":
                return True
            if char not in SIMPLE_ESCAPES:
                return False
            self._release_high(out)
            self._write(SIMPLE_ESCAPES[char], out)
            self._end_escape()
            return True
        if char not in HEX_DIGITS:
            return False
        if len(self._escape) < len("\\u") + UNICODE_ESCAPE_DIGITS:
            return True
        code = int(self._escape[2:], 16)
        if self._high is not None and code in LOW_SURROGATES:  # the pair is one character
            high, self._high = self._high, None
            self._write(chr(0x10000 + ((high - HIGH_SURROGATES.start) << 10) + (code - LOW_SURROGATES.start)), out)
        else:
            self._release_high(out)
            if code in HIGH_SURROGATES:
                self._high = code
            else:
                self._write(chr(code), out)
        self._end_escape()
        return True

    def _end_escape(self) -> None:
        self._escape = ""
        self._expect = _Expect.STRING

    def _release_high(self, out: list[str]) -> None:
        if self._high is not None:
            self._write(chr(self._high), out)
            self._high = None

    def _write(self, char: str, out: list[str]) -> None:
        out.append(escaped_surrogate(char) if ord(char) in SURROGATES else _ENCODE(char)[1:-1])

    def _end_scalar(self, out: list[str]) -> bool:
        token, self._pending = self._pending, ""
        try:
            value = json.loads(token)
        except ValueError:  # no JSON, or an integer past Python's digit limit
            return False
        out.append(json.dumps(value))
        self._value_done()
        return True

    def finish(self) -> str:
        """The output of a scalar that ends the text (a number or literal is whole at the text's end)."""
        if self._expect is not _Expect.SCALAR or self._containers:
            return ""
        out: list[str] = []
        if not self._end_scalar(out):
            self._expect = _Expect.INVALID
            return ""
        self.settled = self._read
        return "".join(out)


def unsent(arguments: str, sent: str) -> str:
    """A call's arguments as the whole answer reads them, less what its stream sent as they were written: a prefix
    of them, whatever the chunking (else the stream and the whole answer would disagree, a bug)."""
    if not arguments.startswith(sent):
        raise AssertionError(f"streamed arguments {sent!r} are not the start of the call's {arguments!r}")
    return arguments[len(sent) :]


def written_arguments(text: str) -> str:
    """The arguments a text opens with, as the whole answer reads them: their compact JSON where it is whole
    (whatever follows it), else, cut short or malformed, the compact text of what reads as JSON, then the rest as
    written. CompactJson reads them, not Python's json, so that a value nested past its recursion limit reads alike
    whatever the caller's depth."""
    reader = CompactJson()
    compact = reader.feed(text)
    compact += reader.finish()
    return compact if reader.whole else compact + text[reader.settled :].rstrip()


class CallArguments:
    """A call written as `{"name": ..., "<key>": <value>}`: its name, and its arguments streamed from the block's
    text as it grows: nothing until the key follows the name (a call laid out otherwise sends its arguments whole
    when it closes), then the value made compact."""

    def __init__(self, name: str, after_name: int, key: str | None) -> None:
        """after_name: where the name ends in the block's text; key: the format's arguments key, or None where the
        value starts there (Mistral's `name[ARGS]{...}`)."""
        self.name = name
        self._at = after_name
        self._key = json.dumps(key) if key is not None else None
        self._value: CompactJson | None = None if key is not None else CompactJson()
        self.value_at = None if key is not None else after_name  # where the value begins, once it is known
        self._off = False  # the key does not follow the name
        self.sent = ""

    @property
    def whole(self) -> bool:
        """Whether the value is whole: `sent` is all of it."""
        return self._value is not None and self._value.whole

    def read(self, block: str) -> str:
        """The compact arguments the block's text so far adds (it only grows)."""
        if self._off:
            return ""
        if self._value is None:
            value_at = self._value_start(block)
            if value_at is None:
                return ""
            self._value, self._at, self.value_at = CompactJson(), value_at, value_at
        out = self._value.feed(block[self._at :])
        self._at = len(block)
        self.sent += out
        return out

    def _value_start(self, block: str) -> int | None:
        """Where the value begins once `, "<key>":` follows the name; None while the text could still become that
        (and for good where it cannot)."""
        position = self._at
        for expected in (",", self._key, ":"):
            position = _skip_whitespace(block, position)
            written = block[position : position + len(expected)]
            if not expected.startswith(written):
                self._off = True
                return None
            if len(written) < len(expected):
                return None
            position += len(expected)
        return position


def _skip_whitespace(text: str, position: int) -> int:
    while position < len(text) and text[position] in WHITESPACE:
        position += 1
    return position
