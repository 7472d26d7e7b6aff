"""Mistral's tool calls (`--tool-call-parser mistral`): what follows its [TOOL_CALLS] control token, in the layout
of the model's tokenizer version.

- Before v11 (Mistral-7B-Instruct-v0.3): one JSON array of calls, `[TOOL_CALLS] [{"name": ..., "arguments": {...}}]`.
- v11 and later (Mistral Small 3.1+, Devstral, Magistral): each call as `[TOOL_CALLS]name[ARGS]{...}`, the
  arguments the JSON object after the [ARGS] token; v13 writes `[CALL_ID]id` before [ARGS].

A chat template that writes [ARGS] shows the second; without a template, a tokenizer with an [ARGS] token. Reading
(calls_reader.CallsReader, a piece between tags at a time) tells them apart by what follows each tag: JSON (an
array of calls, or one) is read by call_sequence.CallSequence; a name is a call once the `{` of its arguments
follows it (NamedCall). Either way a call's name and arguments stream as they are written. The tags are control
tokens, which generated text leaves out: a request read for calls keeps them in its text
(shown_special_ids), and the calls take them out again. Mistral's chat templates refuse call ids other than nine
letters and digits: this format makes such ids, and gives the template the last nine characters of others' (as
vLLM does).
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Mapping

from services.gateway.tools.arguments import CallArguments, unsent, written_arguments
from services.gateway.tools.call import (
    COMPACT, CallIds, ParsedCall, calls_array_schema, content_before_tag, grammar_tag, text_or_calls,
)
from services.gateway.tools.call_sequence import (
    ARRAY_OPEN, OBJECT_OPEN, Arguments, CallSequence, Opened, SequenceLayout,
)
from services.gateway.tools.calls_reader import split_calls
from services.gateway.tools.tool_request import FUNCTION_NAME, FunctionDefinition

CALLS_TAG, ARGS_TAG, CALL_ID_TAG = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
TAGS = (CALLS_TAG, ARGS_TAG, CALL_ID_TAG)
CALL_ID_CHARS = 9
CALL_ID_ALPHABET = string.ascii_letters + string.digits
ARRAY_SEPARATOR = " "  # between [TOOL_CALLS] and the array of calls, as the v0.3 template writes them
CALLS = SequenceLayout(arguments_key="arguments", arrays=True)  # before v11
NAMED_CALL = re.compile(
    rf"(?P<name>{FUNCTION_NAME.strip('^$')})\s*(?:{re.escape(CALL_ID_TAG)}\s*\w*\s*)?(?:{re.escape(ARGS_TAG)})?\s*"
)
OPENED_CALL = re.compile(rf"\s*{NAMED_CALL.pattern}(?=\{{)")  # a v11 call, once its arguments' `{` is written


class Mistral(CallIds):
    name = "mistral"
    arguments_key = CALLS.arguments_key
    calls_after_opening = True  # read by calls_reader.CallsReader, a piece between tags at a time
    piece_tag = CALLS_TAG
    text_after_calls = False
    calls_open_answer = False

    def __init__(self, special_tokens: Mapping[str, int] | None = None, chat_template: str | None = None) -> None:
        """special_tokens: the tokenizer's special tokens by text; its tags among them are written as tokens.
        chat_template: the model's, when known: whether it writes [ARGS] tells the layout."""
        self.tag_ids = {tag: special_tokens[tag] for tag in TAGS if tag in (special_tokens or {})}
        # v11 and later. The template says what the model was trained to write (a tokenizer may name [ARGS] before
        # its models write it); without one, the tokenizer.
        self.per_call_tags = ARGS_TAG in (chat_template if chat_template is not None else self.tag_ids)

    @property
    def shown_special_ids(self) -> tuple[int, ...]:
        """The control tokens a request read for calls keeps in its text."""
        return tuple(self.tag_ids.values())

    def new_call_id(self) -> str:
        return "".join(secrets.choice(CALL_ID_ALPHABET) for _ in range(CALL_ID_CHARS))

    def template_call_id(self, call_id: str) -> str:
        return call_id[-CALL_ID_CHARS:]

    def grammar(self, functions: list[FunctionDefinition], parallel: bool) -> str:
        calls_tag = self._tag(CALLS_TAG)
        if self.per_call_tags:
            named = self._named_calls(functions)
            return f"start: {'call+' if parallel else 'call'}\ncall: {calls_tag} ({named})\n"
        array = json.dumps(self._array(functions, parallel))
        return f"start: {calls_tag} {json.dumps(ARRAY_SEPARATOR)} %json {array}\n"

    def _named_calls(self, functions: list[FunctionDefinition]) -> str:
        """From v11: what follows [TOOL_CALLS] in a call of any of `functions` (Lark alternatives)."""
        args_tag = self._tag(ARGS_TAG)
        return " | ".join(
            f"{json.dumps(f.name)} {args_tag} %json {json.dumps({**f.schema, 'x-guidance': COMPACT})}"
            for f in functions
        )

    def _array(self, functions: list[FunctionDefinition], parallel: bool) -> dict:
        """Before v11: the schema of the array of calls after [TOOL_CALLS]."""
        return calls_array_schema(functions, parallel, self.arguments_key)

    def text_or_calls_grammar(
        self, functions: list[FunctionDefinition], parallel: bool, block_open: str | None = None,
        answer: bool = False,
    ) -> str:
        """Text without [TOOL_CALLS], or text then calls of `functions` in the forced grammar's layout; neither
        opens with `block_open` (tools/call.text_or_calls)."""
        if self.per_call_tags:
            call = f"({self._named_calls(functions)})"
            between: str | None = "" if parallel else None
        else:
            call, between = f"{json.dumps(ARRAY_SEPARATOR)} %json {json.dumps(self._array(functions, parallel))}", None
        return text_or_calls(CALLS_TAG, self.tag_ids.get(CALLS_TAG), call, between, block_open, answer=answer)

    def _tag(self, tag: str) -> str:
        return grammar_tag(tag, self.tag_ids.get(tag))

    def split(self, text: str) -> tuple[str, list[ParsedCall]]:
        """(the text before the calls, the calls); all text when what follows the first [TOOL_CALLS] is no call
        (calls_reader.CallsReader)."""
        return split_calls(self, text)

    def calls_opening(self, text: str) -> tuple[int, int] | None:
        start = text.find(CALLS_TAG)
        return None if start < 0 else (start, start + len(CALLS_TAG))

    def content_until(self, held: str) -> int:
        """How much of a streamed answer's text held so far goes out as content (call.content_before_tag)."""
        return content_before_tag(held, CALLS_TAG)

    def piece_reader(self, piece: str) -> CallSequence | NamedCall | None:
        """What reads a piece after a tag: JSON (an array of calls or one, before v11), or a name and its arguments
        (from v11); None while the piece is only whitespace."""
        head = piece.lstrip()
        if not head:
            return None
        return CallSequence(CALLS) if head[0] in (ARRAY_OPEN, OBJECT_OPEN) else NamedCall()


class NamedCall:
    """A v11 call, `name[ARGS]{...}` (v13: `name[CALL_ID]id[ARGS]{...}`), read as it grows: its name goes out once
    the `{` of its arguments follows it, then its arguments as they are written; cut short or malformed, they are
    what was written (compact where it reads as JSON: arguments.written_arguments)."""

    def __init__(self) -> None:
        self.text = ""
        self.failed = False
        self.over = False
        self.after = None  # nothing after a call in its piece is the answer's
        self._arguments: CallArguments | None = None

    @property
    def called(self) -> bool:
        return self._arguments is not None

    def feed(self, text: str, final: bool) -> list[Opened | Arguments]:
        self.text += text
        events: list[Opened | Arguments] = []
        if self._arguments is None and (match := OPENED_CALL.match(self.text)) is not None:
            self._arguments = CallArguments(match["name"], match.end(), key=None)
            events.append(Opened(self._arguments.name))
        if self._arguments is not None and (streamed := self._arguments.read(self.text)):
            events.append(Arguments(streamed))
        if final:
            self.over, self.failed = True, self._arguments is None
            if self._arguments is not None:
                arguments = written_arguments(self.text[self._arguments.value_at :])
                if rest := unsent(arguments, self._arguments.sent):
                    events.append(Arguments(rest))
        return events
