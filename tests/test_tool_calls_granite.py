"""Granite's tool calls (services/gateway/tools/granite.py) without a model: the array after <|tool_call|> read
whole and streamed alike, text that is not calls left as text, the format told from Granite's chat template, and
what the grammars of tool_choice and allowed_tools allow read back as calls, the tag written as its token and kept
in the detokenizer's text."""

from __future__ import annotations

import json
from pathlib import Path

import llguidance
import pytest
from tokenizers import Tokenizer as HFTokenizer

from services.gateway.tools.formats import Hermes, format_for
from services.gateway.tools.granite import CALL_TAG, TEXT_TAG, Granite
from services.gateway.tools.tool_request import ToolFields
from services.worker.demo_model.tokenizer import train_tokenizer
from shared.structured import StructuredOutput, grammar_of, ll_tokenizer
from shared.tokenizer import Tokenizer
from tests.toolgrammar import (
    ALLOWED_TIME, TIME, WEATHER, check_allowed_auto, check_reads_calls, check_stays_text, forced_answers,
)

CALLS = ('[{"name": "get_weather", "arguments": {"city": "Paris", "metric": true}}, '
         '{"name": "get_time", "arguments": {}}]')
# (answer, content) whose calls are toolgrammar.EXPECTED
ANSWERS = [
    (CALL_TAG + CALLS, ""), ("Let me check. " + CALL_TAG + " " + CALLS, "Let me check."),
    (TEXT_TAG + CALLS, ""), ("Let me check.\n" + TEXT_TAG + CALLS, "Let me check."),  # Granite 3.1's spelling
]
NOT_CALLS = [
    "No tools needed: 4.",
    CALLS,  # the array without the tag is an answer in JSON
    CALL_TAG + '[{"name": "get_weather"}]',  # no arguments
    CALL_TAG + "[]",
    TEXT_TAG + "get_time()",
]
# How Granite 3.x's chat templates write an assistant's calls
TEMPLATE = ("{%- if message.tool_calls %}{{- '<|start_of_role|>assistant<|end_of_role|><|tool_call|>' + "
            "message.tool_calls | tojson + '<|end_of_text|>' }}{%- endif %}")


@pytest.mark.parametrize(("answer", "content"), ANSWERS)
def test_the_array_after_the_tag_reads_the_same_whole_and_in_any_cut(answer: str, content: str) -> None:
    check_reads_calls("granite", answer, content)


@pytest.mark.parametrize("answer", NOT_CALLS)
def test_what_is_not_calls_stays_text_whole_and_streamed(answer: str) -> None:
    check_stays_text("granite", answer)


def test_granites_template_picks_the_format_and_its_tag_token() -> None:
    fmt = format_for(TEMPLATE, "auto", {CALL_TAG: 49153})
    assert isinstance(fmt, Granite) and fmt.shown_special_ids == (49153,)
    assert isinstance(format_for("<tool_call>{{ call | tojson }}</tool_call>", "auto", {}), Hermes)
    text_tag = Granite({})  # a tokenizer without the tag as a token writes it as text
    fields = ToolFields(tools=[TIME], tool_choice="required")
    assert text_tag.shown_special_ids == ()
    assert text_tag.grammar(fields.callable, False).startswith(f"start: {json.dumps(CALL_TAG)} ")


def granite_tokenizer_dir(path: Path) -> Path:
    """A trained byte-level BPE with Granite's tool-call tag as a special token."""
    train_tokenizer(["def f(x):\n    return {'city': x}\n" * 40], 300, path)
    tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens([CALL_TAG])
    tok.save(str(path / "tokenizer.json"))
    return path


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_what_the_forced_grammar_allows_reads_back_as_calls(tmp_path: Path, tool_choice) -> None:
    tokenizer = Tokenizer(granite_tokenizer_dir(tmp_path))
    assert forced_answers(format_for(None, "granite", tokenizer.special_tokens), tokenizer, CALL_TAG, tool_choice,
                          tmp_path)


def test_allowed_auto_answers_are_text_or_calls_of_the_allowed_tools(tmp_path: Path) -> None:
    tokenizer = Tokenizer(granite_tokenizer_dir(tmp_path))
    check_allowed_auto(format_for(None, "granite", tokenizer.special_tokens), tokenizer, CALL_TAG, tmp_path)


def test_allowed_auto_text_holds_neither_spelling_of_the_tag(tmp_path: Path) -> None:
    """Text that opened calls by Granite 3.1's spelling would read as calls of any tool, allowed or not: the grammar
    of allowed_tools auto rules it out as it rules out the token's text."""
    tokenizer = Tokenizer(granite_tokenizer_dir(tmp_path))
    fmt = format_for(None, "granite", tokenizer.special_tokens)
    fields = ToolFields(tools=[WEATHER, TIME], tool_choice=ALLOWED_TIME)
    grammar = grammar_of(StructuredOutput(kind="grammar", spec=fmt.text_or_calls_grammar(fields.callable, True)))
    ll = ll_tokenizer(tmp_path, tokenizer.vocab_size, tuple(tokenizer.eos_token_ids))
    for text, allowed in [("Sunny today.", True), ("Sure. " + TEXT_TAG + CALLS, False),
                          ("Sure. " + CALL_TAG + CALLS, False)]:
        tokens = tokenizer.encode(text, add_special_tokens=False)
        assert (llguidance.LLMatcher(ll, grammar).validate_tokens(tokens) == len(tokens)) is allowed, text
