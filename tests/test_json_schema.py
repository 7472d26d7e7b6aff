"""JSON schemas as constraints read them (shared/json_schema.py): objects that list their properties get no others,
in response_format and in tools' parameters, unless the schema asks for more; allOf's branches stay open."""

from __future__ import annotations

import json
from pathlib import Path

import llguidance
import pytest

from services.gateway.tools.formats import FORMATS
from services.gateway.tools.tool_request import FunctionDefinition, ToolFields
from shared.json_schema import closed_objects
from shared.structured import JSON_OPTIONS, StructuredOutput, grammar_of, ll_tokenizer

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


BASE = {"type": "object", "properties": {"id": {"type": "integer"}}}
EMAIL = {"type": "object", "properties": {"email": {"type": "string"}}}
# (schema, an object it allows that closing every listed object would refuse), from a review
EXTENDED = [
    ({"allOf": [PERSON, EMAIL]}, '{"name":"a","email":"b"}'),
    ({"$defs": {"B": BASE}, "allOf": [{"$ref": "#/$defs/B"}, EMAIL]}, '{"id":1,"email":"b"}'),
    ({"definitions": {"B": BASE}, "allOf": [{"$ref": "#/definitions/B"}, EMAIL]}, '{"id":1,"email":"b"}'),
    ({"$defs": {"B": BASE}, "$ref": "#/$defs/B", "properties": {"email": {"type": "string"}}}, '{"id":1,"email":"b"}'),
    ({"type": "object", "properties": {"kind": {"type": "string"}}, "required": ["kind"],
      "oneOf": [{"properties": {"kind": {"const": "a"}, "x": {"type": "integer"}}, "required": ["x"]},
                {"properties": {"kind": {"const": "b"}, "y": {"type": "integer"}}, "required": ["y"]}]},
     '{"kind":"a","x":1}'),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}, '{"a":1,"b":2}'),
    ({"allOf": [{"allOf": [{"properties": {"a": {"type": "integer"}}}]}, {"properties": {"b": {"type": "integer"}}}]},
     '{"a":1,"b":2}'),
    # From a second review: what stands under an extension is one too; beside anyOf, required or a $ref rule on keys;
    # a chain of definitions in any order; an escaped definition name
    ({"allOf": [{"properties": {"x": {"properties": {"a": {"type": "integer"}}}}},
                {"properties": {"x": {"properties": {"b": {"type": "integer"}}}}}]}, '{"x":{"a":1,"b":2}}'),
    ({"type": "object", "required": ["x"], "anyOf": [{"properties": {"x": {"type": "integer"}}}]}, '{"x":1}'),
    ({"$defs": {"B": BASE}, "$ref": "#/$defs/B", "required": ["z"]}, '{"id":1,"z":2}'),
    ({"$defs": {"C": BASE, "B": {"$ref": "#/$defs/C"}, "A": {"$ref": "#/$defs/B"}},
      "allOf": [{"$ref": "#/$defs/A"}, EMAIL]}, '{"id":1,"email":"b"}'),
    ({"$defs": {"a/b": BASE}, "allOf": [{"$ref": "#/$defs/a~1b"}, EMAIL]}, '{"id":1,"email":"b"}'),
    # From a third: a key or items described again by an extension beside them
    ({"type": "object", "properties": {"a": {"type": "object", "properties": {"x": {"type": "integer"}}}},
      "allOf": [{"properties": {"a": {"type": "object", "properties": {"y": {"type": "integer"}}}}}]},
     '{"a":{"x":1,"y":2}}'),
    ({"$defs": {"A": {"type": "object", "properties": {"x": {"type": "integer"}}}},
      "type": "object", "properties": {"a": {"$ref": "#/$defs/A"}},
      "allOf": [{"properties": {"a": {"type": "object", "properties": {"y": {"type": "integer"}}}}}]},
     '{"a":{"x":1,"y":2}}'),
    ({"type": "array", "items": {"type": "object", "properties": {"x": {"type": "integer"}}},
      "allOf": [{"items": {"type": "object", "properties": {"y": {"type": "integer"}}}}]}, '[{"x":1,"y":2}]'),
]


@pytest.mark.parametrize(("schema", "allowed"), EXTENDED)
def test_an_object_extended_beside_its_properties_stays_open(schema: dict, allowed: str) -> None:
    """allOf's branches, a definition used as one, anyOf/oneOf beside properties, $ref beside them, a required key
    not listed: closing would refuse what the schema means (or leave nothing to write)."""
    assert _accepts(_grammar(closed_objects(schema)), allowed)


@pytest.mark.parametrize("ref", ["#", "#/properties/a", "#/$defs/W/properties/inner", "#/$defs/a%20b"])
def test_a_schema_that_refers_to_anything_but_a_definition_by_name_is_left_as_it_is(ref: str) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "kid": {"$ref": ref}}, "$defs": {"W": BASE}}
    assert closed_objects(schema) == schema


def test_a_definition_used_as_a_whole_object_is_closed() -> None:
    schema = {"$defs": {"P": PERSON}, "type": "object", "properties": {"who": {"$ref": "#/$defs/P"}}}
    closed = closed_objects(schema)
    assert closed["$defs"]["P"]["additionalProperties"] is False and closed["additionalProperties"] is False
    assert closed_objects({"type": "object"}) == {"type": "object"}  # any object: nothing listed, nothing closed


def _grammar(schema: dict) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)


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
    # OpenAI: a function without parameters takes none
    assert FunctionDefinition(name="nothing").schema == {
        "type": "object", "properties": {}, "additionalProperties": False,
    }


@pytest.mark.parametrize("format_name", ["hermes", "llama3_json", "mistral"])
def test_a_tools_local_definitions_resolve_inside_the_call(format_name: str) -> None:
    """Parameters generated from pydantic models refer to their own $defs; inside the call object those references
    would point nowhere, and the forced call would not compile (a 400)."""
    address = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tool = {"type": "function", "function": {"name": "ship", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/Address"}}, "required": ["to"],
        "$defs": {"Address": address}}}}
    fields = ToolFields(tools=[tool, {"type": "function", "function": {"name": "noop"}}], tool_choice="required")
    spec = FORMATS[format_name].grammar(fields.callable, False)
    grammar = grammar_of(StructuredOutput(kind="grammar", spec=spec))
    call = {"hermes": '<tool_call>\n{"name":"ship","arguments":{"to":{"city":"Oslo"}}}\n</tool_call>',
            "llama3_json": '{"name":"ship","parameters":{"to":{"city":"Oslo"}}}',
            "mistral": '[TOOL_CALLS] [{"name":"ship","arguments":{"to":{"city":"Oslo"}}}]'}[format_name]
    assert _accepts(grammar, call)
    assert not _accepts(grammar, call.replace('"Oslo"}', '"Oslo","zip":1}'))  # the definition is closed too


@pytest.mark.parametrize("format_name", ["hermes", "mistral"])
def test_a_tool_that_refers_to_itself_or_its_parts_compiles_and_means_what_it_says(format_name: str) -> None:
    """A tree (`#` is the parameters' root, not the call's) and a pointer into the parameters: the forced call
    compiles and takes the tree, not a call object as a child; tools whose names run together do not mix."""
    tree = {"type": "object", "required": ["v"], "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}}, "w": {"$ref": "#/properties/v"}}}
    tools = [{"type": "function", "function": {"name": "a", "parameters": tree}},
             {"type": "function", "function": {"name": "a__b", "parameters": {
                 "type": "object", "properties": {"p": {"$ref": "#/$defs/c"}}, "$defs": {"c": {"type": "string"}}}}}]
    spec = FORMATS[format_name].grammar(ToolFields(tools=tools, tool_choice="required").callable, False)
    grammar = grammar_of(StructuredOutput(kind="grammar", spec=spec))

    def call(name: str, arguments: str) -> str:
        if format_name == "hermes":
            return f'<tool_call>\n{{"name":"{name}","arguments":{arguments}}}\n</tool_call>'
        return f'[TOOL_CALLS] [{{"name":"{name}","arguments":{arguments}}}]'

    assert _accepts(grammar, call("a", '{"v":1,"kids":[{"v":2,"kids":[]}],"w":3}'))
    assert not _accepts(grammar, call("a", '{"v":1,"kids":[{"name":"a","arguments":{"v":2}}]}'))
    assert _accepts(grammar, call("a__b", '{"p":"x"}')) and not _accepts(grammar, call("a__b", '{"p":1}'))
