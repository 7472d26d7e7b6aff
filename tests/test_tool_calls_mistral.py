"""Mistral's tool calls (services/gateway/tools/mistral.py) without a model: both layouts read whole and streamed
alike, the grammar tool_choice imposes writes the tags as their tokens and what it forces reads back as calls, call
ids are nine letters and digits and others' reach the template cut to nine, and the detokenizer keeps the tags'
text where it leaves other control tokens out."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer

from services.detokenizer.incremental import IncrementalDecoder, TokenTable
from services.gateway.chat_request import ChatCompletionRequest
from services.gateway.tools.formats import FORMATS, format_for
from services.gateway.tools.mistral import ARGS_TAG, CALL_ID_CHARS, CALLS_TAG, TAGS, Mistral
from services.gateway.tools.tool_calls import message_with_calls
from services.gateway.tools.tool_request import ToolFields
from services.worker.demo_model.tokenizer import train_tokenizer
from shared.structured import StructuredOutput, grammar_of, ll_tokenizer
from shared.tokenizer import Tokenizer
from tests.grammarwalk import walk
from tests.test_tool_calls import _assembled, _streamed

MISTRAL = FORMATS["mistral"]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "metric": {"type": "boolean"}},
    "required": ["city", "metric"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}
EXPECTED = [("get_weather", {"city": "Paris", "metric": True}), ("get_time", {})]
# (answer, content) whose calls are EXPECTED
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
    "[TOOL_CALLS]get_weather[ARGS]{\"city\": ",  # cut short
    "[TOOL_CALLS]get weather[ARGS]{}",  # no function name
]


@pytest.mark.parametrize(("answer", "content"), ANSWERS)
def test_both_layouts_read_the_same_whole_and_in_any_cut(answer: str, content: str) -> None:
    message = {"role": "assistant", "content": answer}
    assert message_with_calls(message, "stop", MISTRAL) == "tool_calls"
    assert message["content"] == (content or None)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == EXPECTED
    for pieces in ([], [1] * (len(answer) - 1), [3, 11, 7]):
        assert _assembled(_streamed(answer, pieces, format_name="mistral"))[:3] == (content, EXPECTED, "tool_calls")


@pytest.mark.parametrize("answer", NOT_CALLS)
def test_what_is_not_calls_stays_text_whole_and_streamed(answer: str) -> None:
    message = {"role": "assistant", "content": answer}
    assert message_with_calls(message, "stop", MISTRAL) == "stop" and message["content"] == answer
    assert _assembled(_streamed(answer, [2] * (len(answer) // 2), format_name="mistral"))[:3] == (answer, [], "stop")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 12), max_size=40))
def test_any_cut_of_a_v11_answer_streams_its_calls(pieces: list[int]) -> None:
    answer, content = ANSWERS[1]
    assert _assembled(_streamed(answer, pieces, format_name="mistral"))[:3] == (content, EXPECTED, "tool_calls")


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
    makes, and every answer the grammar ends reads as calls of the offered functions with schema-valid arguments."""
    tokenizer = Tokenizer(mistral_tokenizer_dir(tmp_path, per_call_tags))
    fmt = format_for(None, "mistral", tokenizer.special_tokens)
    assert fmt.per_call_tags is per_call_tags and len(fmt.shown_special_ids) == (3 if per_call_tags else 1)
    fields = ToolFields(tools=[WEATHER, TIME], tool_choice=tool_choice)
    spec = fmt.grammar(fields.callable, fields.forced_calls_parallel)
    grammar = grammar_of(StructuredOutput(kind="grammar", spec=spec))
    eos = next(iter(tokenizer.eos_token_ids))
    ll = ll_tokenizer(tmp_path, tokenizer.vocab_size, (eos,))
    table = TokenTable.from_tokenizer(tokenizer)
    rng = random.Random(7)
    for _ in range(8):
        generated, _ = walk(ll, grammar, tokenizer, rng, drawn_to=(eos,))
        assert generated[0] == tokenizer.special_tokens[CALLS_TAG]
        text = IncrementalDecoder(table, fmt.shown_special_ids).step(generated, final=True).text
        content, calls = fmt.split(text)
        assert content == "" and calls, text
        if tool_choice != "required":
            assert len(calls) == 1
        for call in calls:
            arguments = json.loads(call.arguments)
            if call.name == "get_weather":
                assert arguments["city"] in ("Paris", "Oslo") and isinstance(arguments["metric"], bool)
            else:
                assert call.name == "get_time" and arguments == {}
        assert (ARGS_TAG in text) is per_call_tags


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
    """Random walks through allowed_tools auto's grammar, drawn to the tag: an answer is text without the tag's
    text, or calls after its token, and every call the answer reads as names the allowed function."""
    tokenizer = Tokenizer(mistral_tokenizer_dir(tmp_path, per_call_tags))
    fmt = format_for(None, "mistral", tokenizer.special_tokens)
    allowed = {"type": "allowed_tools", "allowed_tools": {
        "mode": "auto", "tools": [{"type": "function", "function": {"name": "get_time"}}]}}
    fields = ToolFields(tools=[WEATHER, TIME], tool_choice=allowed)
    grammar = grammar_of(StructuredOutput(kind="grammar", spec=fmt.text_or_calls_grammar(fields.callable, True)))
    eos = next(iter(tokenizer.eos_token_ids))
    tag = tokenizer.special_tokens[CALLS_TAG]
    ll = ll_tokenizer(tmp_path, tokenizer.vocab_size, (eos,))
    table = TokenTable.from_tokenizer(tokenizer)
    rng = random.Random(11)
    answers = {"text": 0, "calls": 0}
    for _ in range(24):
        generated, ended = walk(ll, grammar, tokenizer, rng, drawn_to=(tag, eos), draw=0.2, max_tokens=64)
        if not ended:
            continue  # cut short: a call cut so is read as text (NOT_CALLS)
        text = IncrementalDecoder(table, fmt.shown_special_ids).step(generated, final=True).text
        content, calls = fmt.split(text)
        assert (tag in generated) == bool(calls) and [call.name for call in calls] == ["get_time"] * len(calls)
        answers["calls" if calls else "text"] += 1
    assert answers["text"] and answers["calls"]
