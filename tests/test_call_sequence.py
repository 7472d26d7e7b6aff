"""Calls written as JSON objects in a row (services/gateway/tools/call_sequence.py, calls_reader.py) without a model:
Llama 3 JSON's chained calls and the array after Granite's and Mistral's (before v11) tag. Whatever the answer and
however it is cut into chunks, the stream's content and calls add up to the whole answer's; a call's name goes out
once its arguments open and its arguments as they are written; a call cut short keeps what was written; what is no
call stays text."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.gateway.tools.formats import FORMATS
from services.gateway.tools.tool_calls import message_with_calls
from tests.test_tool_arguments import LAYOUTS, TROUBLE, VALUES
from tests.test_tool_calls import _streamed

EXAMPLES = int(os.environ.get("SPECMESH_FUZZ_EXAMPLES", "300"))  # more with SPECMESH_FUZZ_EXAMPLES
# How each format opens its calls, chains them, and closes them; its arguments key
LAYOUT = {
    "llama3_json": ("<|python_tag|>", "; ", "", "parameters"),
    "granite": ("<|tool_call|>[", ", ", "]", "arguments"),
    "mistral": ("[TOOL_CALLS] [", ", ", "]", "arguments"),
}


def _whole_and_streamed(format_name: Any, answer: str, points: list[int], finish: str) -> tuple[tuple, tuple]:
    """(content, [[name, arguments]]) of the answer read whole, and streamed cut at `points`, by a format (its name,
    or itself)."""
    message = {"role": "assistant", "content": answer}
    message_with_calls(message, finish, FORMATS[format_name] if isinstance(format_name, str) else format_name)
    whole = (message["content"] or "", [[c["function"]["name"], c["function"]["arguments"]]
                                        for c in message.get("tool_calls", ())])
    points = sorted({min(p, len(answer)) for p in points})
    choices = _streamed(answer, [b - a for a, b in zip([0, *points], points)], finish, format_name=format_name)
    calls: dict[int, list[str]] = {}
    for entry in (e for choice in choices for e in choice["delta"].get("tool_calls", ())):
        name, arguments = calls.setdefault(entry["index"], ["", ""])
        calls[entry["index"]] = [name + entry["function"].get("name", ""), arguments + entry["function"]["arguments"]]
    content = "".join(choice["delta"].get("content") or "" for choice in choices)
    return whole, (content, [calls[i] for i in sorted(calls)])


def _argument_deltas(format_name: str, answer: str) -> list[str]:
    """The arguments pieces of an answer streamed a character at a time."""
    choices = _streamed(answer, [1] * (len(answer) - 1), format_name=format_name)
    return [e["function"]["arguments"] for c in choices for e in c["delta"].get("tool_calls", ())
            if e["function"]["arguments"]]


@settings(max_examples=EXAMPLES, deadline=None)
@given(format_name=st.sampled_from(sorted(LAYOUT)), values=st.lists(VALUES, min_size=1, max_size=3),
       layout=LAYOUTS, trouble=st.none() | TROUBLE, at=st.integers(0, 400),
       before=st.sampled_from(["", "Checking. ", "x\n", '{"a": 1} ']), after=st.sampled_from(["", " Done.", "\n"]),
       key=st.sampled_from(["own", "other", "none"]), cut=st.none() | st.integers(0, 400),
       points=st.lists(st.integers(0, 500), max_size=10))
def test_any_answer_reads_the_same_whole_and_streamed_in_any_cut(
    format_name: str, values: list[Any], layout: dict, trouble: str | None, at: int, before: str, after: str,
    key: str, cut: int | None, points: list[int],
) -> None:
    opening, separator, closing, own_key = LAYOUT[format_name]
    arguments_key = {"own": own_key, "other": "arguments" if own_key == "parameters" else "parameters"}.get(key)
    calls = [json.dumps({"name": f"f{i}", **({arguments_key: value} if arguments_key else {})}, **layout)
             for i, value in enumerate(values)]
    answer = before + opening + separator.join(calls) + closing + after
    if trouble is not None:  # somewhere in the calls
        at = len(before) + len(opening) + at % (len(answer) - len(before) - len(opening) + 1)
        answer = answer[:at] + trouble + answer[at:]
    finish = "stop" if cut is None else "length"
    answer = answer if cut is None else answer[: len(before) + cut]
    whole, streamed = _whole_and_streamed(format_name, answer, points, finish)
    assert streamed == whole


@pytest.mark.parametrize("format_name", sorted(LAYOUT))
def test_arguments_stream_as_they_are_written(format_name: str) -> None:
    opening, separator, closing, key = LAYOUT[format_name]
    answer = (opening + '{"name": "write_file", "%s": {"path": "a.py", "text": "print(1)"}}' % key + separator
              + '{"name": "get_time", "%s": {}}' % key + closing)
    deltas = _argument_deltas(format_name, answer)
    assert deltas[:4] == ["{", '"', "p", "a"]  # a character at a time, not at the answer's end
    assert "".join(deltas) == '{"path":"a.py","text":"print(1)"}{}'


@pytest.mark.parametrize(("format_name", "answer", "expected"), [
    # Cut short (max_tokens): the name and what was written of the arguments, compact where it reads as JSON (a
    # number may go on: it stays as written)
    ("llama3_json", 'Checking. {"name": "get_weather", "parameters": {"city": "Pa',
     ("Checking.", [["get_weather", '{"city":"Pa']])),
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": ', ("", [["get_weather", '{"city":']])),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": 1', ("", [["get_weather", '{"city": 1']])),
    # A next call cut before its arguments open is dropped, as its separator
    ("llama3_json", '{"name": "a", "parameters": {}}; {"name": "b"', ("", [["a", "{}"]])),
    ("granite", '<|tool_call|>[{"name": "a", "arguments": {}}, {"name": "b", "argu', ("", [["a", "{}"]])),
    # Text after Llama 3's calls is content; after the tagged formats' it is not the answer's
    ("llama3_json", 'Sure. {"name": "a", "parameters": {"x": 1}} Hope that helps.',
     ("Sure.\nHope that helps.", [["a", '{"x":1}']])),  # a line break keeps the texts apart, as around Hermes calls
    ("llama3_json", '{"name": "a", "parameters": {}}\nDone.', ("Done.", [["a", "{}"]])),
    ("granite", '<|tool_call|>[{"name": "a", "arguments": {}}] Done.', ("", [["a", "{}"]])),
    # After a call, an object that is no call ends the calls
    ("granite", '<|tool_call|>[{"name": "a", "arguments": {}}, {"x": 1}]', ("", [["a", "{}"]])),
    # A call laid out otherwise (arguments first, or under the other key models use) is read when it closes
    ("mistral", '[TOOL_CALLS] [{"arguments": {"x": 1}, "name": "a"}]', ("", [["a", '{"x":1}']])),
    ("granite", '<|tool_call|>[{"name": "a", "parameters": {"x": [1, 2]}}]', ("", [["a", '{"x":[1,2]}']])),
    # Arguments that stop being JSON (a line break inside a string) are kept as written to the end, as Hermes' are
    ("llama3_json", '{"name": "write", "parameters": {"text": "line1\nline2"}} Done.',
     ("", [["write", '{"text":"line1\nline2"}} Done.']])),
    ("granite", '<|tool_call|>[{"name": "a", "arguments": {"x": 01}}]', ("", [["a", '{"x": 01}}]']])),
    # Whole arguments followed by what is no JSON keep the arguments; the rest is dropped
    ("llama3_json", '{"name": "a", "parameters": {"x": 1} oops}; {"name": "b", "parameters": {}}',
     ("", [["a", '{"x":1}']])),
    # Llama 3 calls chained by a python tag, or by nothing but a line break
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {}}<|python_tag|>{"name": "b", "parameters": {}}',
     ("", [["a", "{}"], ["b", "{}"]])),
    ("llama3_json", '{"name": "a", "parameters": {}}\n{"name": "b", "parameters": {}}',
     ("", [["a", "{}"], ["b", "{}"]])),
    # A lone surrogate escape stays an escape (no UTF-8 holds the character)
    ("llama3_json", '{"name": "a", "parameters": {"x": "\\ud83d!"}}', ("", [["a", '{"x":"\\ud83d!"}']])),
    ("granite", '<|tool_call|>[{"name": "a", "arguments": ["\\udc00\\ud83d\\ude00"]}]',
     ("", [["a", '["\\udc00\U0001f600"]']])),
    # Text before Llama 3's call that merely holds braces streams as it is written
    ("llama3_json", 'Use {x} or { "y" }: {"name": "a", "parameters": {}}', ("Use {x} or { \"y\" }:", [["a", "{}"]])),
])
def test_what_each_answer_reads_as_whole_and_streamed(format_name: str, answer: str, expected: tuple) -> None:
    for points in ([], list(range(1, len(answer))), [4, 13, 15, 40]):
        whole, streamed = _whole_and_streamed(format_name, answer, points, "length")
        assert whole == streamed == expected
        json.dumps(whole, ensure_ascii=False).encode()  # UTF-8 carries it, as the answer's bytes must


@pytest.mark.parametrize(("format_name", "answer"), [
    ("llama3_json", '{"name": "Alice", "age": 30}'),  # an answer written in JSON
    ("llama3_json", '{"parameters": {}, "name": "a"}'),  # a Llama 3 call opens with its name
    ("llama3_json", '<|python_tag|>print("hi")'),  # a python tag before code
    ("llama3_json", '{"name": "a", "nested": {"name": "b", "parameters": {}}}'),  # only the first opening counts
    ("granite", "<|tool_call|>[]"),
    ("granite", '<|tool_call|>[{"name": "a"}]'),  # no arguments
    ("mistral", '[TOOL_CALLS] ["a", {"name": "b", "arguments": {}}]'),
])
def test_an_opening_that_no_call_follows_is_text_whole_and_streamed(format_name: str, answer: str) -> None:
    for points in ([], list(range(1, len(answer)))):
        whole, streamed = _whole_and_streamed(format_name, answer, points, "stop")
        assert whole == streamed == (answer, [])


def test_content_before_a_llama3_call_streams_before_the_answer_ends() -> None:
    answer = 'Let me look {that} up. {"name": "get_time", "parameters": {}}'
    choices = _streamed(answer, [len("Let me look {that} up.") + 2], format_name="llama3_json")
    assert choices[0]["delta"]["content"] == "Let me look {that} up."


@pytest.mark.parametrize("format_name", [*sorted(LAYOUT), "hermes"])
def test_arguments_nested_about_pythons_recursion_limit_read_the_same_whole_and_streamed(format_name: str) -> None:
    """Python's json gives up somewhere near 1,000 levels, reading or writing: the call keeps its arguments,
    whole and streamed alike, and nothing raises: its arguments are read without Python's json where it gives up."""
    opening, separator, closing, key = LAYOUT.get(format_name, ("<tool_call>\n", "", "\n</tool_call>", "arguments"))
    for depth in range(940, 1010, 3):
        value = "[" * depth + "]" * depth
        answer = (opening + '{"name": "a", "%s": {"x": %s}}' % (key, value) + separator
                  + ('{"name": "b", "%s": {}}' % key if separator else "") + closing + " Done.")
        for points in ([], [len(answer) - 30], [len(answer) // 2, len(answer) - 3]):
            whole, streamed = _whole_and_streamed(format_name, answer, points, "stop")
            assert whole == streamed, (depth, points)
            assert whole[1][0] == ["a", '{"x":%s}' % value], (depth, points)  # the value, though json cannot read it
