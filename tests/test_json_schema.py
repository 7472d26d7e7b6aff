"""JSON schemas as constraints read them (shared/json_schema.py): objects that list their properties get no others,
in response_format and in tools' parameters, unless the schema asks for more; allOf's branches stay open."""

from __future__ import annotations

import json
from pathlib import Path

import llguidance
import pytest

from services.gateway.tools.tool_request import FunctionDefinition
from shared.json_schema import closed_objects
from shared.structured import StructuredOutput, grammar_of, ll_tokenizer

DEMO = Path(__file__).resolve().parents[1] / "models" / "specmesh-demo"
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name"]}


def test_objects_that_list_properties_are_closed_however_deep() -> None:
    schema = {
        "type": "object",
        "properties": {
            "person": PERSON,
            "people": {"type": "array", "items": PERSON},
            "either": {"anyOf": [PERSON, {"type": "string"}]},
            "properties": {"type": "object", "properties": {"x": {"type": "number"}}},  # a key named "properties"
        },
        "$defs": {"p": PERSON},
    }
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    props = closed["properties"]
    assert props["person"]["additionalProperties"] is False
    assert props["people"]["items"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert props["properties"]["additionalProperties"] is False and set(props["properties"]) == {
        "type", "properties", "additionalProperties"}
    assert closed["$defs"]["p"]["additionalProperties"] is False
    assert "additionalProperties" not in schema and "additionalProperties" not in PERSON  # the input is not changed


@pytest.mark.parametrize("open_ended", [
    {"additionalProperties": True}, {"additionalProperties": {"type": "integer"}},
    {"patternProperties": {"^x-": {"type": "string"}}},
])
def test_a_schema_that_asks_for_more_keys_keeps_them(open_ended: dict) -> None:
    assert closed_objects({**PERSON, **open_ended}) == {**PERSON, **open_ended}


def test_all_of_branches_stay_open_since_each_lists_only_its_own_keys() -> None:
    schema = {"allOf": [PERSON, {"type": "object", "properties": {"email": {"type": "string"}}}]}
    assert closed_objects(schema) == schema
    assert closed_objects({"type": "object"}) == {"type": "object"}  # any object: nothing listed, nothing closed


def _accepts(grammar: str, text: str) -> bool:
    tokenizer = ll_tokenizer(DEMO, 4096, (0,))
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    return bool(matcher.consume_tokens(tokenizer.tokenize_str(text))) and matcher.is_accepting()


def test_the_grammar_refuses_a_key_the_schema_does_not_list() -> None:
    grammar = grammar_of(StructuredOutput(kind="json_schema", spec=json.dumps(PERSON)))
    assert _accepts(grammar, '{"name":"Ada","age":36}')
    assert not _accepts(grammar, '{"name":"Ada",",":250.0}')
    tool = FunctionDefinition(name="add", parameters={"type": "object", "properties": {"a": {"type": "integer"}}})
    assert tool.schema["additionalProperties"] is False
    assert FunctionDefinition(name="anything").schema == {"type": "object"}
