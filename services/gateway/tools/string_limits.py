"""A string's limits in a JSON schema (`minLength`, `maxLength`, `pattern`, `const`) as Lark regexes its raw text
matches whole: for a format that writes string values unquoted (Qwen3-Coder's XML parameters), where llguidance's
%json, which forces them in a JSON string, cannot.

JSON Schema's `pattern` is found anywhere in the string (ECMA-262's search, unanchored): a top-level alternative
that opens with `^` is anchored at the start, one that ends with `$` at the end, and the others may have any text
around them. The rest of the pattern is handed to llguidance's regex engine as written; what it cannot read (a
lookahead, a back-reference, a word boundary) makes the grammar fail to compile, a 400 naming the parameter that
made it, never a pattern left out. Lengths count characters (code points), as JSON Schema does, up to
MAX_FORCED_LENGTH.
"""

from __future__ import annotations

from typing import Any

from shared.structured import choice_regex

ANY_TEXT = "(.|\\n)*"
ESCAPE, CLASS_OPEN, CLASS_CLOSE, GROUP_OPEN, GROUP_CLOSE, ALTERNATIVE = "\\", "[", "]", "(", ")", "|"
START_ANCHOR, END_ANCHOR = "^", "$"
SLASH = "/"  # ends a Lark regex literal: escaped where the pattern has it bare
# The longest length bound forced: llguidance's lexer runs out of fuel on a longer count beside the tags a string's
# text may not hold (a maxLength of 100 already blocks short values), so a longer bound is left out, said so in
# docs/api.md
MAX_FORCED_LENGTH = 64


def text_limits(schema: dict[str, Any]) -> list[str]:
    """Regexes (Lark, without slashes) that a string's whole text matches, one per limit the schema sets."""
    limits = []
    if isinstance(schema.get("const"), str):
        limits.append(choice_regex([schema["const"]]))
    low, high = (bound if isinstance(bound, int) and bound <= MAX_FORCED_LENGTH else None
                 for bound in (schema.get("minLength"), schema.get("maxLength")))
    if low is not None or high is not None:
        limits.append(f"(.|\\n){{{max(low or 0, 0)},{'' if high is None else high}}}")
    if isinstance(schema.get("pattern"), str):
        limits.append(searched(schema["pattern"]))
    return limits


def searched(pattern: str) -> str:
    """The text around a JSON Schema pattern: a regex the whole text matches where the pattern is found in it."""
    anchored = []
    for alternative in _top_level_alternatives(pattern):
        starts = alternative.startswith(START_ANCHOR)
        body = alternative[1:] if starts else alternative
        ends = body.endswith(END_ANCHOR) and not _escaped(body, len(body) - 1)
        body = body[:-1] if ends else body
        anchored.append(f"{'' if starts else ANY_TEXT}({body}){'' if ends else ANY_TEXT}")
    return _slashes_escaped("|".join(f"({alternative})" for alternative in anchored))


def _slashes_escaped(regex: str) -> str:
    """Each bare `/` escaped (one the pattern escapes already stays as it is)."""
    return "".join("\\/" if char == SLASH and not _escaped(regex, i) else char for i, char in enumerate(regex))


def _top_level_alternatives(pattern: str) -> list[str]:
    """The pattern split at each `|` outside groups and classes."""
    alternatives, start, depth, in_class, i = [], 0, 0, False, 0
    while i < len(pattern):
        char = pattern[i]
        if char == ESCAPE:
            i += 2
            continue
        if in_class:
            in_class = char != CLASS_CLOSE
        elif char == CLASS_OPEN:
            in_class = True
        elif char == GROUP_OPEN:
            depth += 1
        elif char == GROUP_CLOSE:
            depth -= 1
        elif char == ALTERNATIVE and depth == 0:
            alternatives.append(pattern[start:i])
            start = i + 1
        i += 1
    return [*alternatives, pattern[start:]]


def _escaped(text: str, at: int) -> bool:
    """Whether the character at `at` follows an odd number of backslashes."""
    backslashes = len(text[:at]) - len(text[:at].rstrip(ESCAPE))
    return backslashes % 2 == 1


