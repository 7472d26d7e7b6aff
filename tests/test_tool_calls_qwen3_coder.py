"""Qwen3-Coder's XML tool calls (services/gateway/tools/qwen3_coder.py): each value read as its schema's type
(text for a string, the JSON of any other type where it is that, else text), the calls the same whole and streamed
in any cut (the arguments going out as they are written, a string's text as it comes), a cut or malformed answer
streamed as a prefix of what the whole one reads, the template picking the format, and the grammars tool_choice
imposes writing only calls of the offered functions whose arguments follow their schemas."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import llguidance
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.gateway.tools.formats import FORMATS, format_for
from services.gateway.tools.qwen3_coder import Qwen3Coder
from services.gateway.tools.tool_calls import StreamedToolCalls, message_with_calls
from services.gateway.tools.tool_request import ToolFields
from services.worker.demo_model.tokenizer import train_tokenizer
from shared.structured import StructuredError, StructuredOutput, check, grammar_of, ll_tokenizer
from shared.tokenizer import Tokenizer
from tests.test_tool_calls import _takes
from tests.toolgrammar import _walks, check_cut_forced_answer

EXAMPLES = int(os.environ.get("SPECMESH_FUZZ_EXAMPLES", "300"))
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {
        "city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "note": {"type": "string"}, "hours": {"type": "array", "items": {"type": "integer"}},
    }, "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}
FUNCTIONS = ToolFields(tools=[WEATHER, TIME]).functions
FORMAT = Qwen3Coder().reading(FUNCTIONS)


def _call(name: str, parameters: list[tuple[str, str]]) -> str:
    """A call as Qwen3-Coder's template writes one."""
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in parameters)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


ANSWER = ("I will look.\n" + _call("get_weather", [("city", "Paris"), ("days", "3"), ("note", 'say "hi"\n<b>'),
                                                   ("hours", "[9, 17]")]) + "\n" + _call("get_time", []))
EXPECTED = [("get_weather", {"city": "Paris", "days": 3, "note": 'say "hi"\n<b>', "hours": [9, 17]}),
            ("get_time", {})]


def _read(answer: str, finish: str = "stop", fmt: Any = FORMAT) -> tuple[str | None, list[list[str]]]:
    message = {"role": "assistant", "content": answer}
    message_with_calls(message, finish, fmt)
    return message["content"], [[c["function"]["name"], c["function"]["arguments"]] for c in message.get(
        "tool_calls", ())]


def _stream(answer: str, pieces: list[int], finish: str = "stop", fmt: Any = FORMAT) -> list[dict]:
    """The chunks' choices for `answer` cut at `pieces` (lengths), the last one finishing."""
    calls = StreamedToolCalls(fmt)
    points = [sum(pieces[:i]) for i in range(len(pieces) + 1)] + [len(answer)]
    texts = [answer[a:b] for a, b in zip(points, points[1:])]
    return [calls.choice({"index": 0, "delta": {"content": text}, "finish_reason": finish if last else None})
            for last, text in ((i == len(texts) - 1, text) for i, text in enumerate(texts))]


def _streamed_calls(answer: str, pieces: list[int], finish: str = "stop") -> tuple[str, list[list[str]]]:
    choices = _stream(answer, pieces, finish)
    content = "".join(choice["delta"].get("content") or "" for choice in choices)
    calls: dict[int, list[str]] = {}
    for entry in (e for choice in choices for e in choice["delta"].get("tool_calls", ())):
        name, arguments = calls.setdefault(entry["index"], ["", ""])
        calls[entry["index"]] = [name + entry["function"].get("name", ""), arguments + entry["function"]["arguments"]]
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("pieces", [[], [1] * (len(ANSWER) - 1), [5, 17, 3, 40]], ids=["whole", "characters", "mixed"])
def test_calls_read_as_their_schemas_types_whole_and_in_any_cut(pieces: list[int]) -> None:
    content, calls = _read(ANSWER)
    assert content == "I will look." and [(name, json.loads(arguments)) for name, arguments in calls] == EXPECTED
    assert _streamed_calls(ANSWER, pieces) == (content, calls)
    assert _read(ANSWER)[1][0][1] == '{"city":"Paris","days":3,"note":"say \\"hi\\"\\n<b>","hours":[9,17]}'


def test_a_value_not_of_its_type_and_a_parameter_of_no_known_type_are_text() -> None:
    answer = _call("get_weather", [("city", "Paris"), ("days", "three"), ("metric", "yes"), ("extra", "42")])
    assert json.loads(_read(answer)[1][0][1]) == {"city": "Paris", "days": "three", "metric": "yes", "extra": "42"}
    untyped = FORMATS["qwen3_coder"]  # without the request's functions every value is text
    assert json.loads(_read(ANSWER, fmt=untyped)[1][0][1])["days"] == "3"


def test_streamed_arguments_go_out_as_they_are_written() -> None:
    answer = _call("get_weather", [("city", "Paris"), ("note", "a long note")])
    choices = _stream(answer, [1] * (len(answer) - 1))
    pieces = [e["function"]["arguments"] for c in choices for e in c["delta"].get("tool_calls", ())
              if e["function"]["arguments"]]
    assert pieces[:3] == ['{"city":"', "P", "a"] and "".join(pieces) == '{"city":"Paris","note":"a long note"}'


def test_a_call_cut_short_keeps_what_was_written_and_blocks_not_calls_are_text() -> None:
    whole = _call("get_weather", [("city", "Paris"), ("note", "half")])
    cut = whole[: whole.index("f\n</parameter>")]  # max_tokens ends the answer inside a value
    assert _read(cut, "length") == (None, [["get_weather", '{"city":"Paris","note":"hal"}']])
    assert _streamed_calls(cut, [1] * (len(cut) - 1), "length") == ("", _read(cut, "length")[1])
    text = "Use <tool_call>\nnot xml\n</tool_call> here."
    assert _read(text) == (text, []) and _streamed_calls(text, [2] * 20) == (text, [])


VALUE_TEXT = st.lists(st.sampled_from([*'ab "\\\n<>/=é', "</parameter", "<parameter=", "\n</", "</function>"]),
                     max_size=8).map("".join)


@settings(max_examples=EXAMPLES, deadline=None)
@given(values=st.lists(st.tuples(st.sampled_from(["city", "days", "metric", "note", "hours", "other"]),
                                 VALUE_TEXT | st.sampled_from(["3", "-1", "true", "[1, 2]", "Paris"])), max_size=4),
       second=st.booleans(), cut=st.none() | st.integers(0, 300), points=st.lists(st.integers(0, 400), max_size=10))
def test_stream_and_whole_answer_agree_in_any_cut(values, second: bool, cut: int | None, points: list[int]) -> None:
    answer = "Text first.\n" + _call("get_weather", values) + ("\n" + _call("get_time", []) if second else "")
    finish = "stop" if cut is None else "length"
    answer = answer if cut is None else answer[:cut]
    points = sorted({min(p, len(answer)) for p in points})
    pieces = [b - a for a, b in zip([0, *points], points)]
    content, calls = _read(answer, finish)
    assert _streamed_calls(answer, pieces, finish) == (content or "", calls)


def test_the_template_that_writes_function_elements_picks_the_format() -> None:
    template = "{% for call in message.tool_calls %}<tool_call>\n<function={{ call.name }}>{% endfor %}"
    assert isinstance(format_for(template), Qwen3Coder)
    assert format_for("<tool_call>{{ call | tojson }}</tool_call>").name == "hermes"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small trained byte-level BPE (a walk through a grammar computes a mask over the vocabulary each token)."""
    path = tmp_path_factory.mktemp("qwen3-coder-tokenizer")
    train_tokenizer([ANSWER * 20, "def f(x):\n    return x\n" * 20], 300, path)
    return path


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer(tokenizer_dir)


def _closing(tokenizer: Tokenizer) -> tuple[int, ...]:
    """The tokens a walk is drawn to: the ends of a value, a function and a call, and the end of the answer."""
    closing = tokenizer.encode("\n</parameter>\n</function>\n</tool_call>", add_special_tokens=False)
    return (*closing, *tokenizer.eos_token_ids)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_what_the_forced_grammar_allows_reads_back_as_valid_calls(
    tokenizer_dir: Path, tokenizer: Tokenizer, tool_choice
) -> None:
    fields = ToolFields(tools=[WEATHER, TIME], tool_choice=tool_choice)
    spec = FORMAT.grammar(fields.callable, fields.forced_calls_parallel)
    answers = list(_walks(FORMAT, tokenizer, spec, tokenizer_dir, seed=5, count=8, drawn_to=_closing(tokenizer),
                          max_tokens=160))
    assert len(answers) >= 3
    for generated, _ in answers[:2]:
        check_cut_forced_answer(FORMAT, tokenizer, generated, fields)
    for _, text in answers:
        content, calls = _read(text)
        assert content is None and calls and (tool_choice == "required" or len(calls) == 1), text
        for name, arguments in calls:
            arguments = json.loads(arguments)
            if name == "get_time":
                assert arguments == {}
                continue
            assert name == "get_weather" and arguments["city"] in ("Paris", "Oslo"), text
            assert isinstance(arguments["days"], int) and not isinstance(arguments["days"], bool), text
            assert set(arguments) <= set(WEATHER["function"]["parameters"]["properties"])
            assert isinstance(arguments.get("metric", True), bool) and isinstance(arguments.get("note", ""), str)
            assert all(isinstance(h, int) for h in arguments.get("hours", []))


def test_allowed_auto_answers_are_text_or_calls_of_the_allowed_tool(tokenizer_dir: Path, tokenizer: Tokenizer) -> None:
    """Text without the tag, or calls of the allowed function only (the grammar's answers, token by token)."""
    allowed = {"type": "allowed_tools", "allowed_tools": {
        "mode": "auto", "tools": [{"type": "function", "function": {"name": "get_time"}}]}}
    fields = ToolFields(tools=[WEATHER, TIME], tool_choice=allowed)
    spec = FORMAT.text_or_calls_grammar(fields.callable, True)
    ll = ll_tokenizer(tokenizer_dir, tokenizer.vocab_size, tuple(tokenizer.eos_token_ids))
    grammar = grammar_of(StructuredOutput(kind="grammar", spec=spec))
    for text, allowed_text in [("Sunny today.", True), ("Sure.\n" + _call("get_time", []), True),
                               (_call("get_time", []) + "\n" + _call("get_time", []), True),
                               ("Sure.\n" + _call("get_weather", [("city", "Paris"), ("days", "1")]), False),
                               ("I would write <tool_call> here", False)]:
        tokens = tokenizer.encode(text, add_special_tokens=False)
        assert (llguidance.LLMatcher(ll, grammar).validate_tokens(tokens) == len(tokens)) is allowed_text, text


def test_text_before_a_next_call_cut_before_its_name_stays_whole_and_streamed() -> None:
    answer = _call("get_time", []) + "\nLet me also check <tool_call>\n"
    assert _read(answer, "length") == ("Let me also check ", [["get_time", "{}"]])  # as Hermes' reads
    assert _streamed_calls(answer, [1] * (len(answer) - 1), "length") == ("Let me also check ", [["get_time", "{}"]])


def test_values_templates_write_back_and_values_no_type_reads_are_text() -> None:
    """Python's True and None, as a template writes a call's earlier arguments back; an integer past Python's digit
    limit and a number past a float's range are text, whole and streamed alike."""
    huge = "9" * 5000
    answer = _call("get_weather", [("city", "Paris"), ("metric", "True"), ("days", huge), ("hours", "None")])
    arguments = json.loads(_read(answer)[1][0][1])
    assert arguments == {"city": "Paris", "metric": True, "days": huge, "hours": "None"}  # hours: an array, not null
    assert _streamed_calls(answer, [7] * (len(answer) // 7)) == ("", _read(answer)[1])
    optional = Qwen3Coder().reading(ToolFields(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"anyOf": [{"type": "number"}, {"type": "null"}]}}}}}]).functions)
    assert [json.loads(_read(_call("f", [("n", value)]), fmt=optional)[1][0][1])["n"] for value in
            ("None", "1e400", "2.5")] == [None, "1e400", 2.5]


REFERRING = {"type": "function", "function": {"name": "locate", "parameters": {
    "type": "object", "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"], "additionalProperties": False}},
    "properties": {"place": {"$ref": "#/$defs/Place"}, "near": {"type": ["integer", "null"]},
                   "level": {"enum": [1, 2]}, "label": {"type": "string"}},
    "required": ["place", "near", "level", "label"], "additionalProperties": False}}}


def test_the_forced_grammar_refuses_values_that_would_read_back_otherwise(tokenizer_dir: Path,
                                                                          tokenizer: Tokenizer) -> None:
    """A string holding a closing tag, a value not of its type (a type list, an enum of numbers), and a reference to
    the function's definitions compiles."""
    fields = ToolFields(tools=[REFERRING], tool_choice="required")
    ll = ll_tokenizer(tokenizer_dir, tokenizer.vocab_size, tuple(tokenizer.eos_token_ids))
    grammar = grammar_of(StructuredOutput(kind="grammar", spec=FORMAT.grammar(fields.callable, False)))

    def call(near: str = "3", level: str = "1", label: str = "home") -> str:
        return _call("locate", [("place", '{"city":"Oslo"}'), ("near", near), ("level", level), ("label", label)])

    for text, allowed in [(call(), True), (call(near="null"), True), (call(near="hello"), False),
                          (call(level="banana"), False), (call(level="3"), False),
                          (call(label="x</tool_call>y"), False), (call(label="x</parameter>y"), False),
                          (call(label="a <parameter=b> c"), True)]:
        tokens = [*tokenizer.encode(text, add_special_tokens=False), *tokenizer.eos_token_ids]  # whole, and ended
        assert (llguidance.LLMatcher(ll, grammar).validate_tokens(tokens) == len(tokens)) is allowed, text




def test_a_parameter_given_by_reference_is_read_and_forced_as_its_type(tokenizer_dir: Path,
                                                                      tokenizer: Tokenizer) -> None:
    """Nested models (pydantic's `$defs`, as agent frameworks send them): an object by reference is an object, read
    and forced as one, and so is an optional one (anyOf a reference and null)."""
    fmt = Qwen3Coder().reading(ToolFields(tools=[REFERRING]).functions)
    answer = _call("locate", [("place", '{"city": "Oslo"}'), ("near", "null"), ("level", "2"), ("label", "x")])
    assert json.loads(_read(answer, fmt=fmt)[1][0][1]) == {"place": {"city": "Oslo"}, "near": None, "level": 2,
                                                          "label": "x"}
    optional = {"type": "function", "function": {"name": "locate", "parameters": {
        **REFERRING["function"]["parameters"], "properties": {
            "place": {"anyOf": [{"$ref": "#/$defs/Place"}, {"type": "null"}]}}, "required": ["place"]}}}
    fmt = Qwen3Coder().reading(ToolFields(tools=[optional]).functions)
    assert json.loads(_read(_call("locate", [("place", "None")]), fmt=fmt)[1][0][1]) == {"place": None}
    grammar = fmt.grammar(ToolFields(tools=[optional], tool_choice="required").callable, False)
    assert "string_value" not in grammar.split("parameter_0_0:")[1].splitlines()[0]  # the object's JSON, not text


LIMITED = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "code": {"type": "string", "pattern": "^[A-Z]{3}$"}, "note": {"type": "string", "minLength": 2, "maxLength": 5},
    "digit": {"type": "string", "pattern": "[0-9]"}, "either": {"type": "string", "pattern": "^ab|cd$"},
    "fixed": {"const": "x/y z"}, "url": {"type": "string", "pattern": "^https?:\\/\\/"},
    "long": {"type": "string", "minLength": 1, "maxLength": 10000}},
    "required": ["code", "note", "digit", "either", "fixed", "url", "long"], "additionalProperties": False}}}


@pytest.mark.parametrize(("values", "taken"), [
    ({}, True), ({"note": "hello"}, True), ({"digit": "9"}, True), ({"either": "zzcd"}, True),
    ({"code": "ABCD"}, False), ({"code": "AB"}, False), ({"note": "h"}, False), ({"note": "hello!"}, False),
    ({"digit": "abc"}, False), ({"either": "zabz"}, False), ({"fixed": "x/y"}, False),
    ({"url": "https://x"}, True), ({"url": "ftp://x"}, False),
    # A bound past string_limits.MAX_FORCED_LENGTH is left out (llguidance cannot count that far beside the tags):
    # short values still close, and the bound within it still holds
    ({"long": "x" * 200}, True), ({"long": ""}, False),
])
def test_a_forced_strings_limits_hold_on_its_text(values: dict, taken: bool) -> None:
    """A string is written as text, not JSON, so %json cannot hold its limits: its length, its pattern (found
    anywhere in it, each alternative anchored where it says, an escaped slash as written) and its const are regexes
    on the text."""
    grammar = grammar_of(StructuredOutput(kind="grammar", spec=FORMAT.grammar(
        ToolFields(tools=[LIMITED], tool_choice="required").callable, False)))
    written = {"code": "ABC", "note": "hey", "digit": "a1b", "either": "abzz", "fixed": "x/y z", "url": "http://a",
               "long": "Paris", **values}
    assert _takes(grammar, _call("f", list(written.items()))) is taken


def test_a_pattern_the_grammar_engine_cannot_read_is_refused_not_dropped(tokenizer_dir: Path,
                                                                          tokenizer: Tokenizer) -> None:
    lookahead = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "string", "pattern": "^(?=a)"}}, "required": ["x"]}}}
    grammar = grammar_of(StructuredOutput(kind="grammar", spec=FORMAT.grammar(
        ToolFields(tools=[lookahead], tool_choice="required").callable, False)))
    with pytest.raises(StructuredError):
        check(grammar, ll_tokenizer(tokenizer_dir, tokenizer.vocab_size, tuple(tokenizer.eos_token_ids)))
