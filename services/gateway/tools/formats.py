"""How a model writes tool calls, by family: the grammar that forces calls (tool_choice `required` or named) and the
parsing of calls out of its text.

- Hermes (Qwen2.5, Qwen3, the demo model): each call is
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, several in a row for parallel calls, possibly
  after some text.
- Llama 3.x JSON: the answer is a call, `{"name": ..., "parameters": {...}}`, possibly after `<|python_tag|>` or
  some text, and possibly more chained with ";".
- Mistral (mistral.py) and Granite 3.x (granite.py): the calls after a tag, to the end of the answer.
- Qwen3-Coder (qwen3_coder.py): `<tool_call>` blocks of XML, a parameter per element; Seed-OSS the same in
  `<seed:tool_call>` blocks, its values inline.

The grammars embed each function's JSON schema (llguidance's `%json`) with the name fixed, compact, so that every
token up to the first argument value is forced and drafted for free (services/worker/grammar/).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from services.gateway.tags import THINK_CLOSE, THINK_OPEN, partial_suffix
from shared.structured import StructuredOutput, lark_regex_literal, not_opening_with
from services.gateway.tools.call import (
    ANSWER, COMPACT, JSON, LAYOUT, NOT_JSON, CallIds, ParsedCall, TextAroundCalls, call_name, call_schema,
    leading_block, parsed_call, text_or_calls,
)
from services.gateway.tools.arguments import CallArguments, written_arguments
from services.gateway.tools.call_sequence import CallSequence, SequenceLayout
from services.gateway.tools.calls_reader import split_calls
from services.gateway.tools.granite import CALL_TAG as GRANITE_TAG, Granite
from services.gateway.tools.mistral import CALLS_TAG, Mistral
from services.gateway.tools.qwen3_coder import QWEN3_CODER, SEED_OSS, Qwen3Coder, SeedOss, XmlArguments
from services.gateway.tools.tool_request import FunctionDefinition

QWEN3_CODER_FUNCTION = "<function="  # how Qwen3-Coder's template writes a call's function
ARGUMENTS = re.compile(r'"(?:arguments|parameters)"\s*:\s*(.*)$', re.DOTALL)
CALL_OPENING = re.compile(r'\{\s*"name"\s*:')  # where a JSON call begins in a Llama 3 answer
# The start of such an opening, at the end of a text: what may still become one
CALL_OPENING_START = re.compile(r'\{\s*(?:"(?:n(?:a(?:m(?:e(?:"\s*)?)?)?)?)?)?\Z')
CALL_SEPARATOR = ";"  # between chained Llama 3 calls
CALL_START = '{"name":'  # a compact Llama 3 call's opening
PYTHON_TAG = "<|python_tag|>"  # Llama 3.1's: what some answers write before each call
# Llama 3's calls: one, or several chained with ";", a python tag, or nothing but whitespace (as models write them)
LLAMA3_CALLS = SequenceLayout(arguments_key="parameters", arrays=False, separators=(CALL_SEPARATOR, PYTHON_TAG),
                              bare_chain=True)
LLAMA3_CALL_BESIDE_ANSWER = SequenceLayout(arguments_key="parameters", arrays=False)  # the grammar's one call


class Hermes(CallIds):
    name = "hermes"
    open_tag, close_tag = "<tool_call>", "</tool_call>"
    arguments_key = "arguments"
    shown_special_ids = ()  # its tags are text
    # Qwen3's reasoning, which the answer may open with: a call tag written there is thought about, not called.
    think_open, think_close = THINK_OPEN, THINK_CLOSE

    def grammar(self, functions: list[FunctionDefinition], parallel: bool) -> str:
        schema = json.dumps(call_schema(functions, self.arguments_key))
        calls = 'call ("\\n" call)*' if parallel else "call"
        return f'start: {calls}\ncall: "{self.open_tag}\\n" %json {schema} "\\n{self.close_tag}"\n'

    def text_or_calls_grammar(
        self, functions: list[FunctionDefinition], parallel: bool, block_open: str | None = None,
        answer: bool = False,
    ) -> str:
        """Text without a call tag, or text then calls of `functions` (several in a row with `parallel`), as the
        forced grammar writes them; after a leading reasoning block, where tags are text, as split reads it. Its
        own block (Qwen3's) is the one a reasoning parser's would be: `block_open` adds nothing."""
        schema = json.dumps(call_schema(functions, self.arguments_key))
        call = f'"\\n" %json {schema} "\\n{self.close_tag}"'
        between = '"\\n"' if parallel else None
        if answer:  # a reasoning parser's grammar reads the block before it, where the model thinks
            return text_or_calls(self.open_tag, None, call, between, answer=True)
        return text_or_calls(self.open_tag, None, call, between, self.think_open, self.think_close)

    def split(self, text: str) -> tuple[str, list[ParsedCall]]:
        """(the text outside the calls, the calls); a block that is not a call stays in the text, and calls are read
        only after a leading reasoning block (none while it is unclosed)."""
        reasoning, rest = leading_block(text, self.think_open, self.think_close)
        if reasoning is None:
            return text, []
        content, calls = self._split_calls(rest, reasoning)
        return (content if calls else text), calls

    def _split_calls(self, text: str, before: str) -> tuple[str, list[ParsedCall]]:
        content, calls, rest = TextAroundCalls(before), [], text
        while (start := rest.find(self.open_tag)) >= 0:
            end = rest.find(self.close_tag, start)
            if end < 0:  # cut short (max_tokens): a call whose name is written keeps the arguments written so far
                truncated = self.partial_call(rest[start + len(self.open_tag) :])
                if truncated is not None or calls:  # else a next call cut before its name: dropped, as its tag
                    content.add(rest[:start])
                    if truncated is not None:
                        content.call()
                        calls.append(truncated)
                    rest = ""
                break
            block = rest[start + len(self.open_tag) : end]
            call = self.parse_block(block) or self.partial_call(block)
            if call is None:
                content.add(rest[: end + len(self.close_tag)])
            else:
                content.add(rest[:start])
                content.call()
                calls.append(call)
            rest = rest[end + len(self.close_tag) :]
        if calls and content.after_call and self.dangling_tag(rest):  # as a stream drops it: nothing since the call
            rest = ""
        content.add(rest)
        return content.text, calls

    def partial_call(self, block: str) -> ParsedCall | None:
        """The call a block that does not parse (unclosed, or not JSON) began: its name and its arguments, whole
        where they were written whole (followed by the rest of a closing tag, or by anything), else their text so
        far."""
        named = call_name(block)
        if named is None:
            return None
        name, name_end = named
        try:
            call = parsed_call(JSON.raw_decode(block.lstrip())[0], self.arguments_key)
        except NOT_JSON:
            call = None
        if call is not None:
            return call
        arguments = ARGUMENTS.search(block, name_end)
        if arguments is None:
            return ParsedCall(name, "")
        return ParsedCall(name, written_arguments(arguments.group(1)))

    def dangling_tag(self, text: str) -> bool:
        """Whether `text` is only the start of another call's opening tag: what an answer cut short after its calls
        ends with, never content."""
        stripped = text.lstrip(LAYOUT)  # the line breaks after the call are layout; the rest is text
        return bool(stripped) and self.open_tag.startswith(stripped)

    def opened_call(self, block: str) -> CallArguments | None:
        """The call a block's text so far opens, once its name is written (its first key)."""
        named = call_name(block)
        return None if named is None else CallArguments(*named, self.arguments_key)

    def parse_block(self, block: str) -> ParsedCall | None:
        try:
            return parsed_call(JSON.decode(block), self.arguments_key)
        except NOT_JSON:
            return None


class Llama3Json(CallIds):
    name = "llama3_json"
    python_tag = PYTHON_TAG
    arguments_key = LLAMA3_CALLS.arguments_key
    calls_after_opening = True  # read by calls_reader.CallsReader
    piece_tag = None
    text_after_calls = True
    shown_special_ids = ()

    def __init__(self, beside_answer: frozenset[str] | None = None) -> None:
        """beside_answer: the functions a request may call where its answer is otherwise constrained (a JSON answer
        beside tools, text_or_calls_grammar's `answer`): then only what that grammar's calls path writes is a call,
        the whole answer one call of one of them; a call-shaped object inside the JSON answer is the answer's."""
        self._beside_answer = beside_answer
        self.calls_open_answer = beside_answer is not None

    def reading(self, functions: Sequence[Any], beside_answer: Sequence[str] | None = None) -> "Llama3Json":
        return self if beside_answer is None else Llama3Json(frozenset(beside_answer))

    def grammar(self, functions: list[FunctionDefinition], parallel: bool) -> str:
        # Llama 3.x calls one function per answer: parallel calls do not exist in this format.
        return f"start: %json {json.dumps(call_schema(functions, self.arguments_key))}\n"

    def text_or_calls_grammar(
        self, functions: list[FunctionDefinition], parallel: bool, block_open: str | None = None,
        answer: bool = False,
    ) -> str:
        """Text that holds nothing split would read as a call (the python tag, an object opening with "name") and
        does not open with `block_open` (tools/call.text_or_calls), or the answer one call of `functions`, compact
        as the forced grammar writes it (Llama 3.x writes a call as the whole answer, and one per answer)."""
        if answer:  # the answer or a call, each its own grammar: a lexeme of the call could not start as JSON does
            return f"start: {ANSWER} | %json {json.dumps(call_schema(functions, self.arguments_key))}\n"
        # The call's opening is one lexeme, written out: text may run up to it and dies only on its last character,
        # where a %json object's `{` lexeme would long be over (the lexer does not go back). The line breaks before
        # it are its own, not the text's, for the same reason (after a reasoning block, its grammar's layout).
        calls = " | ".join(
            f"{json.dumps(json.dumps(f.name) + ',' + json.dumps(self.arguments_key) + ':')} "
            f"%json {json.dumps({**f.schema, 'x-guidance': COMPACT})}"
            for f in functions
        )
        opening = f"{lark_regex_literal(self.python_tag)}|{CALL_OPENING.pattern}"
        not_block = not_opening_with(block_open)
        return (f"start: TEXT | CALL_START ({calls}) \"}}\"\n"
                f"CALL_START: /\\s*{lark_regex_literal(CALL_START)}/\n"
                f"TEXT: /(.|\\n)*/ & ~/(.|\\n)*({opening})(.|\\n)*/{not_block}\n")

    def split(self, text: str) -> tuple[str, list[ParsedCall]]:
        """(the text outside the calls, the calls): one call, or several chained with ";" as some answers write
        them, after `<|python_tag|>` or after some text, and possibly text after them. A JSON object without the
        arguments key is an answer written in JSON, not a call (as vLLM's parser reads it), and the text stays
        whole."""
        return split_calls(self, text)

    def calls_opening(self, text: str) -> tuple[int, int] | None:
        """(where the calls begin, where their JSON begins): the python tag, or the first object that opens with its
        "name" key, whichever comes first; beside an answer, such an object that opens the answer."""
        if self._beside_answer is not None:
            match = CALL_OPENING.match(text, len(text) - len(text.lstrip()))
            return None if match is None else (match.start(), match.start())
        openings = []
        if (tag := text.find(self.python_tag)) >= 0:
            openings.append((tag, tag + len(self.python_tag)))
        if (match := CALL_OPENING.search(text)) is not None:
            openings.append((match.start(), match.start()))
        return min(openings, default=None)

    def content_until(self, held: str) -> int:
        """How much of a streamed answer's text held so far goes out as content, where it holds no opening yet:
        what precedes what may become one (the python tag, or an object opening with "name"), and the whitespace
        before that."""
        if self._beside_answer is not None:  # only an answer that opens so may still be a call
            return 0 if CALL_OPENING_START.fullmatch(held.lstrip()) or not held.strip() else len(held)
        end = len(held) - partial_suffix(held, self.python_tag)
        if (match := CALL_OPENING_START.search(held)) is not None:
            end = min(end, match.start())
        return len(held[:end].rstrip())

    def piece_reader(self, piece: str) -> CallSequence:
        if self._beside_answer is not None:
            return CallSequence(LLAMA3_CALL_BESIDE_ANSWER, self._beside_answer)
        return CallSequence(LLAMA3_CALLS)


ToolFormat = Hermes | Llama3Json | Mistral | Granite | Qwen3Coder | SeedOss
FORMAT_NAMES = (Hermes.name, Llama3Json.name, Mistral.name, Granite.name, Qwen3Coder.name, SeedOss.name)
OpenedCall = CallArguments | XmlArguments  # a call being written, its name known (the block formats')


def make_format(
    name: str, special_tokens: Mapping[str, int] | None = None, chat_template: str | None = None
) -> ToolFormat:
    """The format `name` for a tokenizer with these special tokens (by text) and chat template: Mistral and Granite
    write their tags as tokens, Mistral in the layout its template shows."""
    if name == Mistral.name:
        return Mistral(special_tokens, chat_template)
    if name == Granite.name:
        return Granite(special_tokens)
    plain = {Hermes.name: Hermes, Llama3Json.name: Llama3Json, Qwen3Coder.name: Qwen3Coder, SeedOss.name: SeedOss}
    return plain[name]()


# Each format as a tokenizer without special tokens of its own writes it
FORMATS: dict[str, ToolFormat] = {name: make_format(name) for name in FORMAT_NAMES}


def tool_constraint(
    body: Any, format: ToolFormat | None, block_open: str | None = None, answer: StructuredOutput | None = None,
) -> tuple[str, StructuredOutput] | None:
    """The grammar a chat request's tools impose, and the parameter that makes it: tool_choice `required` or a named
    function make the answer calls of the callable functions and nothing else; allowed_tools `auto` makes it text,
    which does not open with `block_open` (a reasoning block's text tag: reasoning/parser.opening_tag), or calls of
    the allowed ones; plain `auto` does so where a function is `strict` (the others' calls take any arguments).
    `answer`: the answer's own constraint (response_format, ...), which takes the text's place under `auto`: the
    answer follows it, or is calls; forced calls hold no content for it to shape. `none`, and plain `auto` with
    neither, impose none."""
    fields = body.tool_fields
    if not fields.callable:  # tool_choice auto without tools
        return None
    if fields.forces_calls:  # calls only: no content for an answer's constraint to shape
        return fields.grammar_param, StructuredOutput(
            kind="grammar", spec=format.grammar(fields.callable, fields.forced_calls_parallel))
    if fields.limits_calls or fields.beside_answer(answer is not None):
        grammar = format.text_or_calls_grammar(
            fields.grammar_functions, fields.parallel_tool_calls, block_open, answer=answer is not None
        )
    else:
        return None
    return fields.grammar_param, StructuredOutput(kind="grammar", spec=grammar, answer=answer)


def format_for(
    chat_template: str | None, configured: str = "auto", special_tokens: Mapping[str, int] | None = None
) -> ToolFormat | None:
    """The configured format (--tool-call-parser), or the one the chat template writes calls in; None when the
    template shows none this server reads (no tools, or another format): requests with tools are then refused rather
    than read in a format the model does not write."""
    if configured != "auto":
        return make_format(configured, special_tokens, chat_template)
    template = chat_template or ""
    if SEED_OSS.open_tag in template:
        return make_format(SeedOss.name)
    if QWEN3_CODER_FUNCTION in template and QWEN3_CODER.open_tag in template:  # before Hermes: <tool_call> too
        return make_format(Qwen3Coder.name)
    if GRANITE_TAG in template:
        return make_format(Granite.name, special_tokens)
    if Hermes.open_tag in template:
        return make_format(Hermes.name)
    if CALLS_TAG in template:
        return make_format(Mistral.name, special_tokens, template)
    if Llama3Json.python_tag in template or '"parameters"' in template:
        return make_format(Llama3Json.name)
    return None
