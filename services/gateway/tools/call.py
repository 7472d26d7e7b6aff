"""A tool call as every format parses it, and what the formats share to write one: the JSON schema a forced call
follows, the grammar of an answer that may call (allowed_tools `auto`), the arguments' text, the call's id."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from services.gateway.tags import opens_with, partial_suffix
from services.gateway.tools.arguments import escaped_surrogate
from services.gateway.tools.tool_request import FunctionDefinition
from shared.json_schema import embedded
from shared.structured import lark_regex_literal, not_opening_with

COMPACT = {"whitespace_flexible": False}


class JsonObject(dict):
    """A JSON object as a model wrote it: looked up as a dict, written back by json_text with every member in its
    place (a key written twice keeps both), as a stream's compact arguments (arguments.py) have it. Only json's
    encoder reads its members so (orjson, len, == see the dict: the last value of each key)."""

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        super().__init__(pairs)
        self._pairs = pairs

    def items(self):  # json's encoder writes a dict subclass's members from items()
        return self._pairs


def first(obj: dict, key: str) -> Any:
    """The value of the key's first member (a stream has sent it before any other could follow)."""
    return next(value for name, value in obj.items() if name == key)


# What reading a model's JSON may raise: no JSON, an integer past Python's digit limit (ValueError), a value nested
# past the recursion limit
NOT_JSON = (ValueError, RecursionError)
# Reads JSON as models write it (JsonObject); raw_decode: the JSON value a text begins with, whatever follows it
JSON = json.JSONDecoder(object_pairs_hook=JsonObject)


# A call's name: its object's first key, as models write it (a "name" among the arguments is not it)
NAME = re.compile(r'^\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")')


def call_name(text: str) -> tuple[str, int] | None:
    """The name of the call a JSON object's text so far opens, once written (its first key's string), and where it
    ends; None where it is no JSON string."""
    match = NAME.match(text)
    if match is None:
        return None
    try:
        return json.loads(match.group(1)), match.end()
    except ValueError:
        return None


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI's tool_calls carry it


def call_schema(functions: list[FunctionDefinition], arguments_key: str) -> dict[str, Any]:
    """One call of any of `functions` as a JSON object, `name` first, written compact. A function's schema with
    references moves under the root's definitions, named after it, where they find what they point to
    (shared/json_schema.py)."""
    options, definitions = [], {}
    for f in functions:
        arguments, own = embedded(f.schema, f.name)
        definitions |= own
        options.append({
            "type": "object",
            "properties": {"name": {"const": f.name}, arguments_key: arguments},
            "required": ["name", arguments_key],
            "additionalProperties": False,
        })
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, **({"$defs": definitions} if definitions else {}), "x-guidance": COMPACT}


def grammar_tag(tag: str, token: int | None) -> str:
    """A tag in a Lark grammar: its special token, or its text where the tokenizer has no such token."""
    return json.dumps(tag) if token is None else f"<[{token}]>"


def text_or_calls(
    tag: str, tag_token: int | None, call: str, between: str | None, block_open: str | None = None,
    block_close: str | None = None, also_not: tuple[str, ...] = (), answer: bool = False,
) -> str:
    """The Lark grammar of an answer that is text, or text then calls: text never holds the calls' opening `tag`
    (as its text: a tag's text in an answer reads as a call either way), and the tag is followed by `call` (Lark:
    the rest of one call, naming only the callable functions). `tag_token`: the tag's special token, where the
    tokenizer has one; `between`: what stands before each further call's tag, or None for one call at most.
    `block_open`: the text tag of a reasoning block the answer may open with, which neither the text nor the text
    before a call opens with (reasoning/parser.opening_tag); with `block_close`, this grammar reads the block
    itself, as a format that reads no calls in it does (Hermes), so that a tag the model thinks about is not made a
    call. `also_not`: other texts that open calls in the format (another spelling of the tag), which the text never
    holds either. `answer`: the text is instead the request's constrained answer, `@answer` (structured.py's
    StructuredOutput.answer), and calls stand alone; such a grammar reads no block (`block_close`) itself: a
    reasoning parser's grammar stands before it (structured.py's think_first)."""
    tag_regex = lark_regex_literal(tag)
    excluded = not_opening_with(block_open)
    excluded += "".join(f" & ~/(.|\\n)*{lark_regex_literal(other)}(.|\\n)*/" for other in also_not)
    tag_lark = grammar_tag(tag, tag_token)
    if answer:
        text, opening, lark = ANSWER, tag_lark, ""
    else:
        text = "TEXT"
        lark = f"TEXT: /(.|\\n)*/ & ~/(.|\\n)*{tag_regex}(.|\\n)*/{excluded}\n"
        if tag_token is None:
            # The text before a call, tag included, is one lazy lexeme: a greedy one would run into the tag and find
            # no way out of it (text may not hold the tag, and the call's lexeme cannot start inside it). Only a rule
            # takes `lazy`, only a token `&`: the rule is the token.
            opening = "opened"
            lark += f"opened[lazy]: OPENED\nOPENED: /(.|\\n)*{tag_regex}/{excluded}\n"
        else:
            # A special token: no text lexeme holds it, so the text ends where it comes.
            opening = f"TEXT {tag_lark}"
    more = "" if between is None else f" ({' '.join(filter(None, (between, tag_lark)))} call)*"
    rule = f"{text} | {opening} call{more}"
    if block_open is None or block_close is None:
        return f"start: {rule}\ncall: {call}\n{lark}"
    if answer:
        raise ValueError("a grammar of a constrained answer or calls reads no reasoning block of its own")
    open_regex, close_regex = lark_regex_literal(block_open), lark_regex_literal(block_close)
    # A block cut short (max_tokens) holds no calls, and may hold the tag: all of the answer is its text.
    lark += (f"thought[lazy]: /\\s*{open_regex}(.|\\n)*{close_regex}/\n"
             f"UNCLOSED: /\\s*{open_regex}(.|\\n)*/ & ~/(.|\\n)*{close_regex}(.|\\n)*/\n")
    return f"start: answer | thought answer | UNCLOSED\nanswer: {rule}\ncall: {call}\n{lark}"


# A surrogate code point on its own (an escape `\ud83d` no low half follows): no UTF-8 holds it
LONE_SURROGATE = re.compile("[\ud800-\udfff]")


ANSWER = "@answer"  # in a grammar, the request's constrained answer (structured.py's StructuredOutput.answer)


def json_text(value: Any) -> str:
    """A value's JSON, compact, non-ASCII characters as themselves; a lone surrogate stays an escape, as it was
    written (the answer's bytes could not carry it)."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return LONE_SURROGATE.sub(lambda m: escaped_surrogate(m.group()), text)


ARGUMENT_KEYS = ("arguments", "parameters")  # what models name a call's arguments, whatever their format says


def parsed_call(obj: Any, arguments_key: str) -> ParsedCall | None:
    """The call a JSON object is: its arguments under the format's key, else under the other name
    models use; a key written twice counts where it first stands, as a stream reads it."""
    if not isinstance(obj, dict) or "name" not in obj or not isinstance(first(obj, "name"), str):
        return None
    key = next((k for k in (arguments_key, *ARGUMENT_KEYS) if k in obj), None)
    return ParsedCall(first(obj, "name"), json_text(first(obj, key) if key is not None else {}))


def calls_array_schema(functions: list[FunctionDefinition], parallel: bool, arguments_key: str) -> dict[str, Any]:
    """The schema of one JSON array of calls of `functions` (at most one without `parallel`), written compact: what
    Mistral before v11 and Granite write after their calls tag."""
    items = call_schema(functions, arguments_key)
    del items["x-guidance"]
    definitions = items.pop("$defs", None)  # at the root, where the references point
    return {"type": "array", "items": items, "minItems": 1, **({} if parallel else {"maxItems": 1}),
            **({"$defs": definitions} if definitions else {}), "x-guidance": COMPACT}


def content_before_tag(held: str, tag: str) -> int:
    """How much of a streamed answer's text held so far goes out as content, for a format whose calls follow `tag`
    to the end of the answer: what precedes the tag or what may become it, and the whitespace before that."""
    start = held.find(tag)
    end = start if start >= 0 else len(held) - partial_suffix(held, tag)
    return len(held[:end].rstrip())


def leading_block(text: str, open_tag: str | None, close_tag: str | None) -> tuple[str | None, str]:
    """(the reasoning block an answer opens with, tags included, the rest): ("", text) without one (or for a family
    that does not think: no `open_tag`), (None, text) while it is not closed."""
    if open_tag is None or not opens_with(text, open_tag, final=True):
        return "", text
    end = text.find(close_tag)
    if end < 0:
        return None, text
    end += len(close_tag)
    return text[:end], text[end:]


# The line breaks around a call's tags (Hermes', Qwen3-Coder's) and values (Qwen3-Coder's), as chat templates write
# them: not text
LAYOUT = "\n"


def separated(before: str, after: str) -> str:
    """`after`, the text that follows a call, with a line break in front where the call's layout was all that kept it
    apart from the text before (their words would run together)."""
    return LAYOUT + after if before and after and not before[-1].isspace() and not after[0].isspace() else after


class TextAroundCalls:
    """The text of an answer outside its calls, as a whole answer and a stream both read it: the line breaks next to
    a call (around its tags) are layout, dropped, and a line break stands for them where text meets text; any other
    whitespace is text."""

    def __init__(self, start: str = "") -> None:
        self._parts = [start]
        self.after_call = False  # nothing but whitespace since the last call

    def add(self, piece: str) -> None:
        if self.after_call:
            piece = separated(self.text, piece.lstrip(LAYOUT))
            self.after_call = not piece
        self._parts.append(piece)

    def call(self) -> None:
        self._parts = ["".join(self._parts).rstrip(LAYOUT)]
        self.after_call = True

    @property
    def text(self) -> str:
        return "".join(self._parts)


class CallIds:
    """The ids of the calls a format parses: OpenAI's shape, which a chat template takes back as it is."""

    calls_after_opening = False  # whether its calls follow an opening to the answer's end (calls_reader.py)

    def new_call_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    def template_call_id(self, call_id: str) -> str:
        """An earlier call's id as the chat template reads it."""
        return call_id

    def reading(self, functions: Sequence[Any], beside_answer: Sequence[str] | None = None) -> "CallIds":
        """This format reading the calls of a request's functions (one whose reading depends on their schemas makes
        a copy that knows them); beside_answer: the callable functions' names where the answer is otherwise
        constrained (text_or_calls' `answer`), for a format whose calls the answer could look like (Llama 3's)."""
        return self
