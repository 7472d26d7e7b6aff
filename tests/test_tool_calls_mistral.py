"""Mistral's tool calls (services/gateway/tools/mistral.py) without a model: both layouts read whole and streamed
alike, the grammar tool_choice imposes writes the tags as their tokens and what it forces reads back as calls, call
ids are nine letters and digits and others' reach the template cut to nine, and the detokenizer keeps the tags'
text where it leaves other control tokens out."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer

from services.gateway.chat_request import ChatCompletionRequest
from services.gateway.tools.formats import FORMATS, format_for
from services.gateway.tools.mistral import ARGS_TAG, CALL_ID_CHARS, CALLS_TAG, TAGS, Mistral
from services.gateway.tools.tool_calls import message_with_calls
from services.gateway.tools.tool_request import ToolFields
from services.worker.demo_model.tokenizer import train_tokenizer
from shared.tokenizer import Tokenizer
from tests.toolgrammar import (
    EXPECTED, TIME, check_allowed_auto, check_reads_calls, check_stays_text, forced_answers,
)
from tests.test_call_sequence import _whole_and_streamed
from tests.test_tool_calls import _assembled, _streamed

MISTRAL = FORMATS["mistral"]
EXAMPLES = int(os.environ.get("SPECMESH_FUZZ_EXAMPLES", "300"))  # more with SPECMESH_FUZZ_EXAMPLES
# (answer, content) whose calls are toolgrammar.EXPECTED
ANSWERS = [
    # Before v11: one array after the tag
    ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "metric": true}}, '
     '{"name": "get_time", "arguments": {}}]', ""),
    # v11: a tag per call, its arguments after [ARGS]
    ('Checking. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "metric": true}[TOOL_CALLS]get_time[ARGS]{}',
     "Checking."),
    # v13: a call id before [ARGS]
    ('[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris", "metric": true}'
     '[TOOL_CALLS]get_time[CALL_ID]f5g6h7i8j[ARGS]{}', ""),
]
NOT_CALLS = [
    "No tools needed: 4.",
    '{"name": "get_weather", "arguments": {}}',  # JSON without the tag is an answer in JSON
    "[TOOL_CALLS] [{\"name\": \"get_weather\"}]",  # no arguments
    "[TOOL_CALLS]get_weather[ARGS]",  # cut short before its arguments
    "[TOOL_CALLS]hello there[TOOL_CALLS]get_time[ARGS]{}",  # what follows the first tag is no call
    "[TOOL_CALLS]get weather[ARGS]{}",  # no function name
]


@pytest.mark.parametrize(("answer", "content"), ANSWERS)
def test_both_layouts_read_the_same_whole_and_in_any_cut(answer: str, content: str) -> None:
    check_reads_calls("mistral", answer, content)


@pytest.mark.parametrize("answer", NOT_CALLS)
def test_what_is_not_calls_stays_text_whole_and_streamed(answer: str) -> None:
    check_stays_text("mistral", answer)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 12), max_size=40))
def test_any_cut_of_a_v11_answer_streams_its_calls(pieces: list[int]) -> None:
    answer, content = ANSWERS[1]
    assert _assembled(_streamed(answer, pieces, format_name="mistral"))[:3] == (content, EXPECTED, "tool_calls")


def test_a_v11_calls_arguments_stream_as_they_are_written() -> None:
    answer = 'Checking. [TOOL_CALLS]write_file[ARGS]{"path": "a.py", "text": "print(1)"}'
    choices = _streamed(answer, [1] * (len(answer) - 1), format_name="mistral")
    pieces = [e["function"]["arguments"] for c in choices for e in c["delta"].get("tool_calls", ())
              if e["function"]["arguments"]]
    assert pieces[:3] == ["{", '"', "p"] and "".join(pieces) == '{"path":"a.py","text":"print(1)"}'


@pytest.mark.parametrize(("answer", "expected"), [
    # cut short: the name and what was written of the arguments, compact where it reads as JSON
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Pa', ("", [["get_weather", '{"city":"Pa']])),
    # after the calls, what is no call is dropped; what follows an object is not its arguments
    ('[TOOL_CALLS]get_time[ARGS]{} thanks[TOOL_CALLS]oops', ("", [["get_time", "{}"]])),
    # malformed: the text that is no JSON stays apart from the number before it (never 12)
    ('Sure. [TOOL_CALLS]f[ARGS]{"x": 1 2}', ("Sure.", [["f", '{"x":1 2}']])),
    # an array of calls after a v11 call (before v11's layout) is calls too
    ('[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS][{"name": "b", "arguments": {}}]',
     ("", [["a", '{"x":1}'], ["b", "{}"]])),
    # nested past Python's recursion limit: what was written, not an error
    ('[TOOL_CALLS]f[ARGS]{"a": ' + "[" * 1200 + "]" * 1200 + "}",
     ("", [["f", '{"a":' + "[" * 1200 + "]" * 1200 + "}"]])),
])
def test_a_v11_call_is_read_once_its_arguments_open_whole_and_streamed(answer: str, expected: tuple) -> None:
    for points in ([], list(range(1, len(answer))), [4, 13, 15]):
        whole, streamed = _whole_and_streamed("mistral", answer, points, "length")
        assert whole == streamed == expected


V11_VALUE = st.lists(st.sampled_from([*'ab "\\{}[],:', "[TOOL_CALLS]", "[ARGS]", "\n", "1e5", "true"]),
                     max_size=8).map("".join)


@settings(max_examples=EXAMPLES, deadline=None)
@given(values=st.lists(st.tuples(st.sampled_from(["get_weather", "get_time", "bad name"]), V11_VALUE), max_size=3),
       before=st.sampled_from(["", "Checking. ", "x\n"]), cut=st.none() | st.integers(0, 120),
       points=st.lists(st.integers(0, 150), max_size=10))
def test_v11_answers_read_the_same_whole_and_streamed(values, before: str, cut: int | None, points) -> None:
    answer = before + "".join(f"[TOOL_CALLS]{name}[ARGS]{value}" for name, value in values)
    finish = "stop" if cut is None else "length"
    answer = answer if cut is None else answer[:cut]
    whole, streamed = _whole_and_streamed("mistral", answer, points, finish)
    assert streamed == whole


def test_call_ids_are_nine_letters_and_digits_and_others_reach_the_template_cut_to_nine() -> None:
    message = {"role": "assistant", "content": ANSWERS[1][0]}
    message_with_calls(message, "stop", MISTRAL)
    ids = [call["id"] for call in message["tool_calls"]]
    assert all(len(i) == CALL_ID_CHARS and i.isalnum() for i in ids) and len(set(ids)) == 2
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_0123456789abcdef", "type": "function",
                                                                "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_0123456789abcdef", "content": "noon"},
    ]})
    rendered = body.chat(MISTRAL)
    assert rendered[1]["tool_calls"][0]["id"] == rendered[2]["tool_call_id"] == "456789abcdef"[-CALL_ID_CHARS:]
    assert body.chat()[2]["tool_call_id"] == "call_0123456789abcdef"  # as sent for other formats


def mistral_tokenizer_dir(path: Path, per_call_tags: bool = True) -> Path:
    """A trained byte-level BPE with Mistral's tool tags as special tokens ([ARGS] and [CALL_ID] only from v11)."""
    train_tokenizer(["def f(x):\n    return {'city': x}\n" * 40], 300, path)
    tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens(list(TAGS if per_call_tags else (CALLS_TAG,)))
    tok.save(str(path / "tokenizer.json"))
    return path


@pytest.mark.parametrize("per_call_tags", [True, False], ids=["v11", "before-v11"])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_what_the_grammar_allows_reads_back_as_calls(tmp_path: Path, per_call_tags: bool, tool_choice) -> None:
    """Random walks through the forced-call grammar: the tags are their tokens, kept in the text the detokenizer
    makes, and every answer the grammar ends reads as calls of the offered functions with schema-valid arguments
    (tests/toolgrammar.py), in the layout of the tokenizer's version."""
    tokenizer = Tokenizer(mistral_tokenizer_dir(tmp_path, per_call_tags))
    fmt = format_for(None, "mistral", tokenizer.special_tokens)
    assert fmt.per_call_tags is per_call_tags and len(fmt.shown_special_ids) == (3 if per_call_tags else 1)
    texts = forced_answers(fmt, tokenizer, CALLS_TAG, tool_choice, tmp_path)
    assert texts and all((ARGS_TAG in text) is per_call_tags for text in texts)


def test_a_template_that_writes_calls_without_args_picks_the_layout_before_v11() -> None:
    """A tokenizer may name [ARGS] before its models write it (Mistral Small 3.1's): the template tells."""
    special = {tag: 10 + i for i, tag in enumerate(TAGS)}
    array_template = "{% if message.tool_calls %}[TOOL_CALLS] {{ message.tool_calls | tojson }}{% endif %}"
    assert not format_for(array_template, "auto", special).per_call_tags
    assert format_for("[TOOL_CALLS]{{ call.function.name }}[ARGS]{{ args }}", "auto", special).per_call_tags
    assert format_for(None, "mistral", special).per_call_tags  # no template to tell: the tokenizer's
    # A template that writes [ARGS] over a tokenizer without it as a token: the layout is the template's, the tag text
    v11_text = format_for("[TOOL_CALLS]{{ name }}[ARGS]{{ args }}", "auto", {CALLS_TAG: 10})
    assert v11_text.per_call_tags and json.dumps(ARGS_TAG) in v11_text.grammar(ToolFields(
        tools=[TIME], tool_choice="required").callable, False)


def test_a_tokenizer_without_the_tags_writes_them_as_text() -> None:
    fmt = Mistral({})
    fields = ToolFields(tools=[TIME], tool_choice="required")
    assert fmt.shown_special_ids == () and not fmt.per_call_tags
    assert fmt.grammar(fields.callable, False).startswith(f"start: {json.dumps(CALLS_TAG)} ")


@pytest.mark.parametrize("per_call_tags", [True, False], ids=["v11", "before-v11"])
def test_allowed_auto_answers_are_text_or_calls_of_the_allowed_tools(tmp_path: Path, per_call_tags: bool) -> None:
    """Random walks through allowed_tools auto's grammar, drawn to the tag (tests/toolgrammar.py)."""
    tokenizer = Tokenizer(mistral_tokenizer_dir(tmp_path, per_call_tags))
    check_allowed_auto(format_for(None, "mistral", tokenizer.special_tokens), tokenizer, CALLS_TAG, tmp_path)
