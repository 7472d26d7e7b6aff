"""vLLM's structural tags (services/gateway/structural_tag.py) as the grammar engine reads them, on the demo model's
tokenizer: text with no trigger, or text in which each trigger opens one of the structures it begins, its JSON
following the schema and closed by its end, then text again; nothing else."""

from __future__ import annotations

import llguidance
import pytest

from services.gateway.reasoning.parser import FORMATS, opening_tag
from services.gateway.structural_tag import StructuralTag, structural_tag_lark
from shared.config import DEFAULT_MODEL_DIR
from shared.structured import StructuredOutput, check, grammar_of, ll_tokenizer
from shared.tokenizer import Tokenizer

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TAG = StructuralTag.model_validate({"type": "structural_tag", "triggers": ["<function=", "<tool>"], "structures": [
    {"begin": "<function=get_weather>", "schema": CITY, "end": "</function>"},
    {"begin": "<function=get_time>", "schema": {"type": "object", "properties": {}}, "end": "</function>"},
    {"begin": "<tool>", "schema": {"type": "integer"}, "end": ""},
]})


@pytest.fixture(scope="module")
def accepts():
    tokenizer = Tokenizer(DEFAULT_MODEL_DIR)
    ll = ll_tokenizer(DEFAULT_MODEL_DIR, tokenizer.vocab_size, tuple(sorted(tokenizer.eos_token_ids)))
    grammar = grammar_of(StructuredOutput(kind="grammar", spec=structural_tag_lark(TAG)))
    check(grammar, ll)

    def whole(text: str) -> bool:
        """Whether the grammar takes `text` as a whole answer (its tokens, then the end)."""
        matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
        ids = tokenizer.encode(text, add_special_tokens=False)
        return matcher.consume_tokens(ids) and not matcher.is_error() and matcher.is_accepting()

    return whole


@pytest.mark.parametrize("text", [
    "", "plain text, <function without its sign", "say\n<function=get_weather>{\"city\":\"Paris\"}</function> then",
    "<function=get_time>{}</function><function=get_weather>{\"city\":\"Oslo\"}</function>", "n=<tool>42 and on",
])
def test_text_and_triggered_structures_are_taken(accepts, text: str) -> None:
    assert accepts(text)


@pytest.mark.parametrize("text", [
    "<function=get_date>{}</function>",  # no structure begins so
    "<function=get_weather>{\"town\":\"Paris\"}</function>",  # not the schema's object
    "<function=get_weather>{\"city\":\"Paris\"}",  # not closed
    "<function=get_weather> {\"city\":\"Paris\"}</function>",  # JSON compact, as every constraint's
    "<tool>x",
])
def test_a_trigger_goes_on_as_a_structure_or_not_at_all(accepts, text: str) -> None:
    assert not accepts(text)


def test_triggers_and_tags_with_line_breaks_and_regex_syntax_are_literal(accepts) -> None:
    tag = StructuralTag.model_validate({"triggers": ["\n<call>", "[/$"], "structures": [
        {"begin": "\n<call>", "schema": {"type": "integer"}, "end": "\t</call>"},
        {"begin": "[/$(", "schema": {"enum": ["a"]}, "end": ")"}]})
    tokenizer = Tokenizer(DEFAULT_MODEL_DIR)
    ll = ll_tokenizer(DEFAULT_MODEL_DIR, tokenizer.vocab_size, tuple(sorted(tokenizer.eos_token_ids)))
    grammar = grammar_of(StructuredOutput(kind="grammar", spec=structural_tag_lark(tag)))
    check(grammar, ll)
    for text, taken in (("x\n<call>7\t</call> and [/$(\"a\") ok", True), ("x\n<call>7</call>", False),
                        ("[/$x", False), ("a\n<cal", True)):
        matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
        ok = matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False))
        assert (ok and not matcher.is_error() and matcher.is_accepting()) == taken, text


def test_a_schema_may_be_json_text_or_left_out_for_any_json_value() -> None:
    """As vLLM's StructuralTag: `schema` optional (any JSON value), and xgrammar's JSON text taken."""
    tag = StructuralTag.model_validate({"triggers": ["<a>"], "structures": [
        {"begin": "<a>", "end": "</a>"}, {"begin": "<a>", "schema": None, "end": ";"},
        {"begin": "<a>", "schema": '{"type": "integer"}', "end": "!"}]})
    assert [s.schema_ for s in tag.structures] == [{}, {}, {"type": "integer"}]


@pytest.mark.parametrize("tag,problem", [
    ({"triggers": ["<f"], "structures": [{"begin": "<g>", "schema": {}, "end": ""}]}, "starts with none"),
    ({"triggers": ["<f", "<fn"], "structures": [{"begin": "<fn", "schema": {}, "end": ""}]}, "is part of"),
    ({"triggers": [""], "structures": [{"begin": "<fn", "schema": {}, "end": ""}]}, "empty"),
])
def test_triggers_that_could_never_open_a_structure_are_refused(tag: dict, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        StructuralTag.model_validate(tag)


def test_a_reasoning_block_before_the_answer_is_thought_not_tag_text() -> None:
    """Under a reasoning parser (qwen3's, whose block the answer may open with), a trigger thought about inside the
    block opens no structure, and the answer after it follows the tag: its text does not open with the block's
    tag, so the lexer keeps the block's grammar."""
    reasoning = FORMATS["qwen3"].for_chat("<|im_start|>assistant\n", None)
    tokenizer = Tokenizer(DEFAULT_MODEL_DIR)
    ll = ll_tokenizer(DEFAULT_MODEL_DIR, tokenizer.vocab_size, tuple(sorted(tokenizer.eos_token_ids)))
    grammar = grammar_of(StructuredOutput(
        kind="grammar", spec=structural_tag_lark(TAG, opening_tag(reasoning)), think_first=reasoning.think_first,
        think_tags=reasoning.grammar_tags))
    thought = "<think>Should I use <function=get_date>? No.</think>\n\n"
    for text, taken in ((thought + '<function=get_time>{}</function>', True), ("plain", True),
                        (thought + "hi <function=get_date>", False)):
        matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
        ok = matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False))
        assert (ok and not matcher.is_error() and matcher.is_accepting()) == taken, text
