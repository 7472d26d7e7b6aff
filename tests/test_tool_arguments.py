"""A call's arguments streamed as they are written (services/gateway/tools/arguments.py): any JSON value, however it
is laid out, escaped or cut into pieces, streams as the compact text the whole answer's arguments are, and each
piece only adds to what went out; a call whose arguments are cut short or malformed streams a prefix of what the
whole answer reads, so that a Hermes answer's argument deltas add up to its whole calls whatever the chunking."""

from __future__ import annotations

import json
import os
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from services.gateway.tools.arguments import CompactJson, written_arguments
from services.gateway.tools.call import JSON, JsonObject, json_text
from services.gateway.tools.formats import FORMATS
from services.gateway.tools.tool_calls import StreamedToolCalls, message_with_calls

# More with SPECMESH_FUZZ_EXAMPLES, as tests/test_fuzz_requests.py takes it
EXAMPLES = int(os.environ.get("SPECMESH_FUZZ_EXAMPLES", "300"))
SCALARS = st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats() | st.text()
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4)
    | st.lists(st.tuples(st.text(max_size=6), inner), max_size=4).map(JsonObject),  # a key may come twice
    max_leaves=12,
)
LAYOUTS = st.sampled_from([
    {}, {"separators": (",", ":")}, {"indent": 2}, {"indent": 0, "separators": (" ,", " :  ")},
    {"ensure_ascii": False}, {"ensure_ascii": False, "indent": "\t"},
])
# What breaks JSON, or makes it end early: put somewhere into a value's text
TROUBLE = st.sampled_from([",", "}", "]", '"', "\\", "\\u12", "\\ud83d", "x", " ", "\n", "1e", "-", "tru", "\x01"])


def _cuts(text: str, points: list[int]) -> list[str]:
    points = sorted({min(p, len(text)) for p in points})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


def _written(value: Any, layout: dict, escaped_slashes: bool) -> str:
    text = json.dumps(value, **layout)
    return text.replace("/", "\\/") if escaped_slashes else text  # a slash only stands inside strings


@settings(max_examples=EXAMPLES, deadline=None)
@given(value=VALUES, layout=LAYOUTS, escaped_slashes=st.booleans(), points=st.lists(st.integers(0, 400), max_size=8))
def test_any_value_streams_as_its_compact_text_a_piece_at_a_time(
    value: Any, layout: dict, escaped_slashes: bool, points: list[int]
) -> None:
    text = _written(value, layout, escaped_slashes)
    compact = json_text(JSON.decode(text))
    reader, out = CompactJson(), ""
    for piece in _cuts(text, points):
        out += reader.feed(piece)
        assert compact.startswith(out)
    out += reader.finish()
    assert out == compact and (reader.whole or not isinstance(value, (list, dict)))


@settings(max_examples=EXAMPLES, deadline=None)
@given(value=VALUES, layout=LAYOUTS, trouble=TROUBLE, at=st.integers(0, 400), cut=st.integers(0, 400))
def test_what_streams_of_a_broken_or_cut_value_starts_what_the_whole_answer_reads(
    value: Any, layout: dict, trouble: str, at: int, cut: int
) -> None:
    text = _written(value, layout, False)
    text = text[:at] + trouble + text[at:]
    text = text[: max(cut, 1)]
    streamed = CompactJson().feed(text)
    assert written_arguments(text).startswith(streamed)


def _hermes_stream(answer: str, pieces: list[str], finish: str) -> tuple[str, list[list[str]]]:
    calls = StreamedToolCalls(FORMATS["hermes"])
    content, made = "", {}
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        choice = calls.choice({"index": 0, "delta": {"content": piece}, "finish_reason": finish if last else None})
        content += choice["delta"].get("content") or ""
        for entry in choice["delta"].get("tool_calls", ()):
            name, arguments = made.setdefault(entry["index"], ["", ""])
            made[entry["index"]] = [name + entry["function"].get("name", ""),
                                    arguments + entry["function"]["arguments"]]
    return content, [made[i] for i in sorted(made)]


@settings(max_examples=EXAMPLES, deadline=None)
@given(value=VALUES, layout=LAYOUTS, trouble=st.none() | TROUBLE, at=st.integers(0, 300),
       cut=st.none() | st.integers(0, 400), points=st.lists(st.integers(0, 500), max_size=12))
def test_a_hermes_answers_argument_deltas_add_up_to_its_whole_calls(
    value: Any, layout: dict, trouble: str | None, at: int, cut: int | None, points: list[int]
) -> None:
    arguments = _written(value, layout, False)
    if trouble is not None:
        arguments = arguments[:at] + trouble + arguments[at:]
    answer = f'Checking.\n<tool_call>\n{{"name": "f", "arguments": {arguments}}}\n</tool_call>\nThen <tool_call>'
    finish = "stop" if cut is None else "length"
    answer = answer if cut is None else answer[: len("Checking.\n<tool_call>\n") + cut]
    message = {"role": "assistant", "content": answer}
    message_with_calls(message, finish, FORMATS["hermes"])
    whole = [[c["function"]["name"], c["function"]["arguments"]] for c in message.get("tool_calls", ())]
    assert _hermes_stream(answer, _cuts(answer, points), finish) == (message["content"] or "", whole)


def test_arguments_stream_while_they_are_written() -> None:
    answer = '<tool_call>\n{"name": "write_file", "arguments": {"path": "a.py", "text": "print(1)\\n"}}\n</tool_call>'
    calls = StreamedToolCalls(FORMATS["hermes"])
    deltas = []
    for i, char in enumerate(answer):
        choice = calls.choice({"index": 0, "delta": {"content": char},
                               "finish_reason": "stop" if i == len(answer) - 1 else None})
        deltas += [entry["function"]["arguments"] for entry in choice["delta"].get("tool_calls", ())
                   if entry["function"]["arguments"]]
    assert deltas[:4] == ["{", '"', "p", "a"]  # a character at a time, not at the call's end
    assert "".join(deltas) == '{"path":"a.py","text":"print(1)\\n"}'


def test_a_key_written_twice_keeps_both_whole_and_streamed() -> None:
    text = '{"a": 1, "b": 2, "a": 3}'
    assert json_text(JSON.decode(text)) == CompactJson().feed(text) == '{"a":1,"b":2,"a":3}'
    assert json.loads(json_text(JSON.decode(text))) == {"a": 3, "b": 2}  # as a client's json reads it


@settings(max_examples=100, deadline=None)
@given(numbers=st.lists(st.sampled_from(["1.50", "1E5", "-0", "1e400", "0.0e0", "-1.0E-3", "2e+2", "10", "-Infinity",
                                         "NaN"]), min_size=1, max_size=5),
       points=st.lists(st.integers(0, 60), max_size=6))
def test_numbers_stream_as_they_read_back(numbers: list[str], points: list[int]) -> None:
    text = "[" + " , ".join(numbers) + "]"
    reader = CompactJson()
    assert "".join(reader.feed(piece) for piece in _cuts(text, points)) == json_text(JSON.decode(text))


def test_an_integer_past_pythons_digit_limit_streams_as_the_whole_answer_reads_it() -> None:
    """json refuses to read an integer of more than 4300 digits (a ValueError, not a JSONDecodeError): the call
    keeps it as written, whole and streamed alike."""
    answer = '<tool_call>\n{"name": "f", "arguments": {"n": ' + "9" * 5000 + '}}\n</tool_call>'
    message = {"role": "assistant", "content": answer}
    message_with_calls(message, "stop", FORMATS["hermes"])
    whole = [[c["function"]["name"], c["function"]["arguments"]] for c in message["tool_calls"]]
    assert whole[0][1].startswith('{"n": 9999')  # what reads as JSON made compact, then the rest as written
    assert _hermes_stream(answer, _cuts(answer, [60, 200, 3000]), "stop") == ("", whole)
