"""Granite's tool calls (Granite 3.x, `--tool-call-parser granite`): the answer's calls as one JSON array after the
<|tool_call|> tag, `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]`, possibly after some text. Granite 3.1
writes the tag as the text `<tool_call>` instead (vLLM's granite parser reads both): that opens calls too.

The tag is a control token of Granite's tokenizer, which generated text leaves out: a request read for calls keeps
it in its text (shown_special_ids), and the calls take it out again; the grammar tool_choice imposes writes it as
that token, and text under allowed_tools `auto` holds neither spelling. A tokenizer without the token has the tag
written as text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from services.gateway.tools.call import (
    CallIds, ParsedCall, calls_array_schema, content_before_tag, grammar_tag, text_or_calls,
)
from services.gateway.tools.call_sequence import CallSequence, SequenceLayout
from services.gateway.tools.calls_reader import split_calls
from services.gateway.tools.tool_request import FunctionDefinition

CALL_TAG = "<|tool_call|>"
TEXT_TAG = "<tool_call>"  # Granite 3.1's spelling, as text
CALLS = SequenceLayout(arguments_key="arguments", arrays=True)


class Granite(CallIds):
    name = "granite"
    arguments_key = CALLS.arguments_key
    calls_after_opening = True  # read by calls_reader.CallsReader
    piece_tag = None
    text_after_calls = False  # the calls run to the answer's end
    calls_open_answer = False

    def __init__(self, special_tokens: Mapping[str, int] | None = None) -> None:
        self.tag_id = (special_tokens or {}).get(CALL_TAG)

    @property
    def shown_special_ids(self) -> tuple[int, ...]:
        """The control token a request read for calls keeps in its text."""
        return () if self.tag_id is None else (self.tag_id,)

    def grammar(self, functions: list[FunctionDefinition], parallel: bool) -> str:
        return f"start: {grammar_tag(CALL_TAG, self.tag_id)} %json {self._array(functions, parallel)}\n"

    def text_or_calls_grammar(
        self, functions: list[FunctionDefinition], parallel: bool, block_open: str | None = None,
        answer: bool = False,
    ) -> str:
        """Text without the tag, or text then the array of calls of `functions`; neither opens with `block_open`
        (tools/call.text_or_calls)."""
        return text_or_calls(CALL_TAG, self.tag_id, f"%json {self._array(functions, parallel)}", None, block_open,
                             also_not=(TEXT_TAG,), answer=answer)

    def split(self, text: str) -> tuple[str, list[ParsedCall]]:
        """(the text before the calls, the calls); all text when what follows the first tag, in either spelling, is
        no call (calls_reader.CallsReader)."""
        return split_calls(self, text)

    def calls_opening(self, text: str) -> tuple[int, int] | None:
        """(where the first tag is, in either spelling, where the calls after it begin)."""
        found = [(start, start + len(tag)) for tag in (CALL_TAG, TEXT_TAG) if (start := text.find(tag)) >= 0]
        return min(found, default=None)

    def piece_reader(self, piece: str) -> CallSequence:
        return CallSequence(CALLS)

    def content_until(self, held: str) -> int:
        """How much of a streamed answer's text held so far goes out as content: what precedes either spelling of
        the tag or what may become one (call.content_before_tag)."""
        return min(content_before_tag(held, tag) for tag in (CALL_TAG, TEXT_TAG))

    def _array(self, functions: list[FunctionDefinition], parallel: bool) -> str:
        return json.dumps(calls_array_schema(functions, parallel, self.arguments_key))
