"""Mistral's tool calls (`--tool-call-parser mistral`): what follows its [TOOL_CALLS] control token, in the layout
of the model's tokenizer version.

- Before v11 (Mistral-7B-Instruct-v0.3): one JSON array of calls, `[TOOL_CALLS] [{"name": ..., "arguments": {...}}]`.
- v11 and later (Mistral Small 3.1+, Devstral, Magistral): each call as `[TOOL_CALLS]name[ARGS]{...}`, the
  arguments the JSON object after the [ARGS] token; v13 writes `[CALL_ID]id` before [ARGS].

A chat template that writes [ARGS] shows the second; without a template, a tokenizer with an [ARGS] token. Reading
tells them apart by what follows the first tag: JSON (an array, or an object) is read whole, or it is all text; a
name is a call once the `{` of its arguments follows it, and its name and arguments then stream as they are
written (tool_calls.ToolCallStream). The
tags are control tokens, which generated text leaves out: a request read for calls keeps them in its text
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

from services.gateway.tools.arguments import CallArguments, partial_arguments
from services.gateway.tools.call import (
    COMPACT, JSON, NOT_JSON, CallIds, ParsedCall, calls_array_schema, content_before_tag, grammar_tag, json_calls,
    json_text, json_value, text_or_calls,
)
from services.gateway.tools.tool_request import FUNCTION_NAME, FunctionDefinition

CALLS_TAG, ARGS_TAG, CALL_ID_TAG = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
TAGS = (CALLS_TAG, ARGS_TAG, CALL_ID_TAG)
CALL_ID_CHARS = 9
CALL_ID_ALPHABET = string.ascii_letters + string.digits
ARRAY_SEPARATOR = " "  # between [TOOL_CALLS] and the array of calls, as the v0.3 template writes them
NAMED_CALL = re.compile(
    rf"(?P<name>{FUNCTION_NAME.strip('^$')})\s*(?:{re.escape(CALL_ID_TAG)}\s*\w*\s*)?(?:{re.escape(ARGS_TAG)})?\s*"
)
OPENED_CALL = re.compile(rf"\s*{NAMED_CALL.pattern}(?=\{{)")  # a v11 call, once its arguments' `{` is written


class Mistral(CallIds):
    name = "mistral"
    arguments_key = "arguments"
    # From v11 each call's name and arguments go out as they are written; before, the calls go out once the answer
    # ends, read as a whole answer is (tool_calls.ToolCallStream._feed_pieces)
    streams_pieces = True
    open_tag = CALLS_TAG

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
    ) -> str:
        """Text without [TOOL_CALLS], or text then calls of `functions` in the forced grammar's layout; neither
        opens with `block_open` (tools/call.text_or_calls)."""
        if self.per_call_tags:
            call = f"({self._named_calls(functions)})"
            between: str | None = "" if parallel else None
        else:
            call, between = f"{json.dumps(ARRAY_SEPARATOR)} %json {json.dumps(self._array(functions, parallel))}", None
        return text_or_calls(CALLS_TAG, self.tag_ids.get(CALLS_TAG), call, between, block_open)

    def _tag(self, tag: str) -> str:
        return grammar_tag(tag, self.tag_ids.get(tag))

    def split(self, text: str) -> tuple[str, list[ParsedCall]]:
        """(the text before the calls, the calls); all text when what follows the first [TOOL_CALLS] is no call.
        From v11, a call is read once its name and the `{` of its arguments are written (as a stream sends it):
        arguments cut short or malformed are what was written (compact where it reads as JSON), and a piece
        after the calls that is no call is dropped. Before v11 the JSON after the tag is calls whole, or text."""
        start = text.find(CALLS_TAG)
        if start < 0:
            return text, []
        pieces = text[start + len(CALLS_TAG) :].split(CALLS_TAG)
        calls: list[ParsedCall] = []
        if pieces[0].strip().startswith(("[", "{")):  # before v11
            for piece in pieces:
                parsed = _calls_in(piece.strip())
                if parsed is None:
                    return text, []
                calls += parsed
        else:
            first = named_call(pieces[0])
            if first is None:
                return text, []
            calls = [first, *(call for piece in pieces[1:] for call in self.later_calls(piece))]
        return text[:start].rstrip(), calls

    def later_calls(self, piece: str) -> list[ParsedCall]:
        """The calls a piece after the first call holds: a v11 call, or the JSON of calls before v11; none (it is
        dropped) where it is neither."""
        call = named_call(piece)
        if call is not None:
            return [call]
        return _calls_in(piece.strip()) or [] if piece.strip().startswith(("[", "{")) else []

    def opened_call(self, piece: str) -> CallArguments | None:
        """The call a v11 piece's text so far opens: its name, once the `{` of its arguments follows it."""
        match = OPENED_CALL.match(piece)
        return None if match is None else CallArguments(match["name"], match.end(), key=None)

    def content_until(self, held: str) -> int:
        """How much of a streamed answer's text held so far goes out as content (call.content_before_tag)."""
        return content_before_tag(held, CALLS_TAG)


def named_call(piece: str) -> ParsedCall | None:
    """The v11 call a piece holds once its name and the `{` of its arguments are written: the arguments whole,
    else what was written of them (arguments.partial_arguments)."""
    match = OPENED_CALL.match(piece)
    if match is None:
        return None
    rest = piece[match.end() :]
    try:
        value = JSON.raw_decode(rest)[0]
    except NOT_JSON:  # cut short or malformed
        return ParsedCall(match["name"], partial_arguments(rest))
    return ParsedCall(match["name"], json_text(value))


def _calls_in(piece: str) -> list[ParsedCall] | None:
    """The calls one [TOOL_CALLS] introduces: a JSON array of them or one call object (before v11), or a name and
    its arguments (v11 and later); None when the piece is anything else."""
    if piece.startswith(("[", "{")):
        return json_calls(piece, "arguments")
    match = NAMED_CALL.match(piece)
    if match is None:
        return None
    arguments = json_value(piece[match.end() :])
    if not isinstance(arguments, dict):
        return None
    return [ParsedCall(match["name"], json_text(arguments))]
