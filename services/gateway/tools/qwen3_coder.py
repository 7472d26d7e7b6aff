"""Qwen3-Coder's tool calls (`--tool-call-parser qwen3_coder`): each call a `<tool_call>` block of XML, a parameter
per element, its value as written (code needs no JSON escaping):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A value's type comes from the function's schema: a string parameter's value is its text (the line breaks next to its
tags are layout), as is an untyped one's; any other is read as JSON of a type the schema allows where the text is
that (`True` and `None` too, as templates write Python's values back), else kept as text. A value ends at the first
`</parameter>`. The arguments are those pairs as a compact JSON object, members where they were written.

Streamed, a call's name goes out once `<function=name>` is written, and its arguments as they are written: each
key once its tag closes, a string's text as it comes (made JSON as the whole answer's), any other value once its
element closes, so that the pieces add up to the whole answer's arguments.

The grammar tool_choice imposes writes each function's parameters in its schema's order, the required ones always,
a string's text up to its closing tag (holding neither `</parameter>` nor `</tool_call>`: reading would end there),
a string enum's value, a string within its limits (length, pattern, const: string_limits.py), any other value as
its schema's JSON. A parameter whose name holds `>` or a line break is never written.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from services.gateway.tags import partial_suffix
from services.gateway.tools.call import (
    COMPACT, JSON, LAYOUT, NOT_JSON, CallIds, ParsedCall, TextAroundCalls, json_text, leading_block, text_or_calls,
)
from services.gateway.tools.string_limits import text_limits
from services.gateway.tools.tool_request import FunctionDefinition
from shared.json_schema import embedded
from shared.structured import lark_regex_literal

FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
PARAMETER_OPEN = "<parameter="
PARAMETER_CLOSE = "</parameter>"
FUNCTION_CLOSE = "</function>"
KEY = re.compile(r"[a-zA-Z0-9_.-]+")  # a parameter name the grammar writes (no `>`, no line break)
ROOT_DEFINITIONS = "parameters"
MAX_REFERENCE_HOPS = 8  # a reference to a reference...: past this, the schema reads as untyped
JSON_KINDS = (("boolean", bool), ("integer", int), ("number", (int, float)), ("null", type(None)),
              ("object", dict), ("array", list), ("string", str))


def parameter_types(functions: Sequence[FunctionDefinition]) -> dict[str, dict[str, Any]]:
    """Each function's parameters' schemas, by function and parameter name, with what they refer to in place."""
    return {f.name: {key: inlined(schema, f.parameters or {})
                     for key, schema in ((f.parameters or {}).get("properties") or {}).items()}
            for f in functions}


def inlined(schema: Any, root: dict[str, Any]) -> dict[str, Any]:
    """A parameter's schema with a local reference (`#/...` into `root`, the function's schema), its own or its
    alternatives', replaced by what it points to (nested models: pydantic puts them under `$defs`), as far as its
    types are concerned."""
    if not isinstance(schema, dict):
        return {}
    for _ in range(MAX_REFERENCE_HOPS):
        ref = schema.get("$ref")
        if not (isinstance(ref, str) and ref.startswith("#")):
            break
        schema = _pointed(root, ref)
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            schema = {**schema, key: [_pointed(root, option["$ref"]) if isinstance(option, dict)
                                      and isinstance(option.get("$ref"), str) else option for option in schema[key]]}
    return schema


def _pointed(root: dict[str, Any], ref: str) -> dict[str, Any]:
    """What a local JSON pointer points to in root; {} (untyped) where it points nowhere."""
    target: Any = root
    for part in ref.removeprefix("#").strip("/").split("/") if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        target = target.get(part) if isinstance(target, dict) else None
    return target if isinstance(target, dict) else {}


def _kinds(schema: dict[str, Any]) -> set[str]:
    """The JSON types a parameter's schema allows: its `type`s, its alternatives' (anyOf, oneOf), its enum's or
    const's values'; none for an untyped one."""
    kinds = schema.get("type")
    found = set(kinds if isinstance(kinds, list) else [kinds] if isinstance(kinds, str) else [])
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) or ():
            found |= _kinds(option) if isinstance(option, dict) else set()
    for value in [*(schema.get("enum") or ()), *([schema["const"]] if "const" in schema else [])]:
        found.add(next(kind for kind, python in JSON_KINDS if isinstance(value, python)))
    return found


def is_text(schema: dict[str, Any] | None) -> bool:
    """Whether a parameter's value is its text: a string, or a parameter the schema gives no type."""
    kinds = _kinds(schema or {})
    return not kinds or "string" in kinds


def value_of(text: str, schema: dict[str, Any] | None) -> Any:
    """A parameter's value from its text: the text for a string (or a parameter the schema does not type), else
    the JSON of a type it allows that the text is (`True`, `None`: as a template writes Python's values back), or
    the text where it is none."""
    if is_text(schema):
        return text
    kinds, stripped = _kinds(schema), text.strip()
    if "boolean" in kinds and stripped.lower() in ("true", "false"):
        return stripped.lower() == "true"
    if "null" in kinds and stripped in ("null", "None"):
        return None
    try:
        value = JSON.decode(stripped)
    except NOT_JSON:
        return text
    if isinstance(value, float) and not math.isfinite(value):
        return text
    kind = next(kind for kind, python in JSON_KINDS if isinstance(value, python))
    return value if kind in kinds or (kind == "integer" and "number" in kinds) else text


class XmlArguments:
    """A call's name, and its arguments streamed from its block's text as it grows (the text after
    `<function=name>`)."""

    def __init__(self, name: str, after_name: int, types: dict[str, Any], value_break: str = LAYOUT) -> None:
        """value_break: what the family writes around a value (XmlLayout's), not part of it."""
        self.name = name
        self._at = after_name
        self._types = types
        self._break = value_break
        self._key: str | None = None  # the open parameter's
        self._text_value = False  # its value is its text (a string)
        self._value_at = 0  # where its value's text starts
        self._streamed = 0  # how much of a string value went out
        self._count = 0  # parameters opened
        self.closed = False  # </function> was written
        self.sent = ""

    def read(self, block: str) -> str:
        """The compact arguments the block's text so far adds (it only grows)."""
        out: list[str] = []
        while not self.closed:
            if self._key is None:
                if not self._next_parameter(block, out):
                    break
                continue
            end = block.find(PARAMETER_CLOSE, self._value_at)
            if end < 0:
                if self._text_value:
                    self._stream_string(block, len(block) - _closing_suffix(block, self._break), out)
                break
            self._close_parameter(block, end, out)
        return self._sent(out)

    def finish(self, block: str) -> str:
        """The rest of the arguments of a block that ends before its function closes (cut short, or closed without
        `</function>`): the value cut short as far as it was written, and the object's end."""
        out: list[str] = []
        if self._key is not None:
            if self._text_value:
                out.append('"')
            else:
                text = _cut_value(block[self._value_at :], self._break)
                out.append(json_text(value_of(text, self._types.get(self._key))))
            self._key = None
        if not self.closed:
            out.append("}" if self._count else "{}")
            self.closed = True
        return self._sent(out)

    def _sent(self, out: list[str]) -> str:
        piece = "".join(out)
        self.sent += piece
        return piece

    def _next_parameter(self, block: str, out: list[str]) -> bool:
        """Opens the next parameter once its tag is whole, or closes the object at </function>."""
        start = block.find(PARAMETER_OPEN, self._at)
        close = block.find(FUNCTION_CLOSE, self._at)
        if close >= 0 and (start < 0 or close < start):
            out.append("{}" if self._count == 0 else "}")
            self.closed = True
            return False
        tag_end = block.find(">", start) if start >= 0 else -1
        if tag_end < 0:
            return False
        self._key = block[start + len(PARAMETER_OPEN) : tag_end]
        out.append(("{" if self._count == 0 else ",") + json.dumps(self._key, ensure_ascii=False) + ":")
        self._count += 1
        self._value_at, self._streamed = tag_end + 1, 0
        self._text_value = is_text(self._types.get(self._key))
        if self._text_value:
            out.append('"')
        return True

    def _stream_string(self, block: str, until: int, out: list[str]) -> None:
        """A string value's text up to `until` that went out not yet (a leading line break waits: layout)."""
        text = block[self._value_at : until]
        if text in ("", self._break[: len(text)]):
            return
        text = text.removeprefix(self._break)
        out.append(json_text(text[self._streamed :])[1:-1])
        self._streamed = len(text)

    def _close_parameter(self, block: str, end: int, out: list[str]) -> None:
        if self._text_value:  # its text up to the line break before its closing tag (layout)
            layout = self._break and block.endswith(self._break, self._value_at, end)
            self._stream_string(block, end - len(self._break) if layout else end, out)
            out.append('"')
        else:
            text = _value_text(block[self._value_at : end], self._break)
            out.append(json_text(value_of(text, self._types.get(self._key))))
        self._key, self._at = None, end + len(PARAMETER_CLOSE)


def _value_text(text: str, value_break: str) -> str:
    """A value's text without the layout next to its tags."""
    return text.removeprefix(value_break).removesuffix(value_break)


@dataclass(frozen=True)
class XmlLayout:
    """How a family writes its XML calls: the block's tags, and what stands between a value and its tags."""

    open_tag: str
    close_tag: str
    value_break: str  # around each value: Qwen3-Coder's line break; Seed-OSS writes its values inline

    @property
    def opening(self) -> str:
        """After a parameter's name, before its value."""
        return ">" + self.value_break

    @property
    def closing(self) -> str:
        """After a value, as the template writes it."""
        return self.value_break + PARAMETER_CLOSE + LAYOUT

    @property
    def string_text(self) -> str:
        """Lark: a string's text and its closing: it ends at the first closing tag, and holds no other tag (the
        value and the call would end there when the answer is read)."""
        tags = f"{lark_regex_literal(PARAMETER_CLOSE)}|{lark_regex_literal(self.close_tag)}"
        return f"/(.|\\n)*{self.closing_lark}/ & ~/(.|\\n)*({tags})(.|\\n)*{self.closing_lark}/"

    @property
    def closing_lark(self) -> str:
        """`closing` in a Lark regex, its line breaks written `\\n` (a regex literal holds no line break)."""
        return "\\n".join(lark_regex_literal(part) for part in self.closing.split(LAYOUT))


QWEN3_CODER = XmlLayout("<tool_call>", "</tool_call>", LAYOUT)
SEED_OSS = XmlLayout("<seed:tool_call>", "</seed:tool_call>", "")


class Qwen3Coder(CallIds):
    name = "qwen3_coder"
    layout = QWEN3_CODER
    shown_special_ids = ()  # its tags are text
    think_open = think_close = None  # Qwen3-Coder does not think

    def __init__(self, functions: Sequence[FunctionDefinition] = ()) -> None:
        self._types = parameter_types(functions)

    @property
    def open_tag(self) -> str:
        return self.layout.open_tag

    @property
    def close_tag(self) -> str:
        return self.layout.close_tag

    def reading(
        self, functions: Sequence[FunctionDefinition], beside_answer: Sequence[str] | None = None,
    ) -> "Qwen3Coder":
        """This format reading the calls of these functions, their parameters typed by their schemas."""
        return type(self)(functions)

    def opened_call(self, block: str) -> XmlArguments | None:
        """The call a block's text so far opens, once its function's name is written."""
        match = FUNCTION.match(block)
        if match is None:
            return None
        return XmlArguments(match.group(1), match.end(), self._types.get(match.group(1), {}), self.layout.value_break)

    def split(self, text: str) -> tuple[str, list[ParsedCall]]:
        """(the text outside the calls, the calls); calls are read only after a leading reasoning block where the
        family thinks in one (none while it is unclosed)."""
        reasoning, rest = leading_block(text, self.think_open, self.think_close)
        if reasoning is None:
            return text, []
        content, calls = TextAroundCalls(reasoning), []
        while (start := rest.find(self.open_tag)) >= 0:
            end = rest.find(self.close_tag, start)
            block = rest[start + len(self.open_tag) : end if end >= 0 else len(rest)]
            call = self.parse_block(block)
            if call is None and end >= 0:
                content.add(rest[: end + len(self.close_tag)])
            elif call is not None:
                content.add(rest[:start])
                content.call()
                calls.append(call)
            elif calls:  # a next call cut before its name: dropped, as its tag; the text before it stays
                content.add(rest[:start])
                rest = ""
                break
            else:
                break
            rest = "" if end < 0 else rest[end + len(self.close_tag) :]
        if calls and content.after_call and self.dangling_tag(rest):
            rest = ""
        content.add(rest)
        return content.text, calls

    def parse_block(self, block: str) -> ParsedCall | None:
        """The call a block (closed, or cut short) holds once its function's name is written: the parameters whose
        tags are whole, the last one's value as far as it was written. Read as a stream reads it, all at once."""
        opened = self.opened_call(block)
        if opened is None:
            return None
        return ParsedCall(opened.name, opened.read(block) + opened.finish(block))

    def partial_call(self, block: str) -> ParsedCall | None:
        return self.parse_block(block)

    def dangling_tag(self, text: str) -> bool:
        """Whether `text` is only the start of another call's opening tag: what an answer cut short after its calls
        ends with, never content."""
        stripped = text.lstrip(LAYOUT)
        return bool(stripped) and self.open_tag.startswith(stripped)

    def grammar(self, functions: list[FunctionDefinition], parallel: bool) -> str:
        calls = 'call ("\\n" call)*' if parallel else "call"
        call = f"call: {json.dumps(self.open_tag)} {self._call_rest(functions)}"
        return f"start: {calls}\n{call}\n{self._rules(functions)}"

    def text_or_calls_grammar(
        self, functions: list[FunctionDefinition], parallel: bool, block_open: str | None = None,
        answer: bool = False,
    ) -> str:
        """Text without a call tag, or text then calls of `functions` (several in a row with `parallel`), as the
        forced grammar writes them; neither opens with `block_open` (tools/call.text_or_calls)."""
        between = '"\\n"' if parallel else None
        calls = text_or_calls(self.open_tag, None, self._call_rest(functions), between, block_open, answer=answer)
        return calls + self._rules(functions)

    def _call_rest(self, functions: list[FunctionDefinition]) -> str:
        """What follows the opening tag in a call of any of `functions`."""
        options = " | ".join(f"function_{i}" for i in range(len(functions)))
        return f'"\\n" ({options}) {json.dumps(LAYOUT + self.close_tag)}'

    def _rules(self, functions: list[FunctionDefinition]) -> str:
        rules = [f"STRING_VALUE: {self.layout.string_text}", "string_value[lazy]: STRING_VALUE"]  # one lazy lexeme
        for i, function in enumerate(functions):
            _, definitions = embedded(function.schema, ROOT_DEFINITIONS)  # its references, from a parameter's schema
            schema = definitions.get(ROOT_DEFINITIONS, function.schema)
            properties = schema.get("properties") or {}
            required = set(schema.get("required") or ())
            parts = []
            for j, (key, value_schema) in enumerate(properties.items()):
                if not KEY.fullmatch(key):  # a key the format cannot write: never a forced argument
                    continue
                rule = f"parameter_{i}_{j}"
                opening = json.dumps(f"{PARAMETER_OPEN}{key}{self.layout.opening}")
                value, own_rules = _value_grammar(value_schema, definitions, f"{i}_{j}", self.layout)
                rules += [f"{rule}: {opening} {value}", *own_rules]
                parts.append(rule if key in required else f"{rule}?")
            if not properties and schema.get("additionalProperties", True) is not False:
                rules.append(f"any_parameter_{i}: {json.dumps(PARAMETER_OPEN)} /{KEY.pattern}/ "
                             f"{json.dumps(self.layout.opening)} string_value")
                parts.append(f"any_parameter_{i}*")
            head = json.dumps(f"<function={function.name}>{LAYOUT}")
            rules.append(f"function_{i}: {head} {' '.join(parts)} {json.dumps(FUNCTION_CLOSE)}")
        return "\n".join(rules) + "\n"


class SeedOss(Qwen3Coder):
    """Seed-OSS's calls (`--tool-call-parser seed_oss`): Qwen3-Coder's XML in `<seed:tool_call>` blocks, each value
    written inline between its tags (`<parameter=city>Paris</parameter>`), read and forced alike."""

    name = "seed_oss"
    layout = SEED_OSS
    # Its thinking, which the answer may open with: a call written there is thought about, not called
    think_open, think_close = "<seed:think>", "</seed:think>"


def _value_grammar(
    schema: dict[str, Any], definitions: dict[str, Any], name: str, layout: XmlLayout,
) -> tuple[str, list[str]]:
    """Lark: a parameter's value and its closing tag (one of its enum's strings, a string's text within its limits
    (string_limits.py), any other value as its schema's JSON with the function schema's definitions it refers to),
    and the rules it needs beside it, named after `name`."""
    resolved = inlined(schema, {"$defs": definitions})
    if is_text(resolved):
        options = resolved.get("enum")
        if options and all(isinstance(option, str) for option in options):
            return f"({' | '.join(json.dumps(option) for option in options)}) {json.dumps(layout.closing)}", []
        limits = text_limits(resolved) if "string" in _kinds(resolved) else []
        if not limits:
            return "string_value", []
        # The text within each limit, then its closing tag; one lazy lexeme, as string_value
        within = "".join(f" & /({limit}){layout.closing_lark}/" for limit in limits)
        return f"string_value_{name}", [f"STRING_VALUE_{name}: {layout.string_text}{within}",
                                        f"string_value_{name}[lazy]: STRING_VALUE_{name}"]
    embedded_schema = {**schema, **({"$defs": definitions} if definitions else {}), "x-guidance": COMPACT}
    return f"%json {json.dumps(embedded_schema)} {json.dumps(layout.closing)}", []


def _closing_suffix(text: str, value_break: str) -> int:
    """How much of the end of a value's text may be the start of its closing tag (with the layout before it or not:
    the first closing tag ends the value)."""
    return max(partial_suffix(text, value_break + PARAMETER_CLOSE), partial_suffix(text, PARAMETER_CLOSE))


def _cut_value(text: str, value_break: str) -> str:
    """A value cut short: its text so far, without the layout before it or the start of its closing tag."""
    text = text.removeprefix(value_break)
    return text[: len(text) - _closing_suffix(text, value_break)]
