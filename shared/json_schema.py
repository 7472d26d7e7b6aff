"""JSON schemas as constraints read them: an object whose keys the schema fully lists has no others.

JSON Schema allows any further key where a schema does not say `additionalProperties`, and a model under such a
schema writes some (a review saw `{"name": ",", "age": 100, ",": 250.0}`). OpenAI's strict mode refuses a schema
without `additionalProperties: false`, and vLLM's default grammar backend (xgrammar) reads one that says nothing as
closed; so does specmesh, where closing cannot change which objects the schema means: only an object that lists
`properties`, requires none but those, and is not extended by a combinator (`allOf`, `anyOf`/`oneOf` beside its own
properties, `$ref` beside them, `if`, `not`, dependent schemas), nor used as such an extension through `$ref`. A
schema that wants more keys says so (`additionalProperties: true`, or a schema for them, or `patternProperties`).

Also: a schema's local definitions lifted to the root of a schema that embeds it (a tool's parameters inside a
call object), where its `#/$defs/...` references would no longer resolve.
"""

from __future__ import annotations

from typing import Any

OPEN_ENDED = ("additionalProperties", "patternProperties", "unevaluatedProperties")
# Keywords that add keys to an object from elsewhere: such an object's own properties are not all its keys
EXTENDED_BY = ("allOf", "anyOf", "oneOf", "$ref", "if", "then", "else", "not", "dependentSchemas", "dependencies")
OWN_SCHEMA_MAPS = ("properties", "patternProperties")  # name -> a schema of its own
OWN_SCHEMAS = ("items", "additionalItems", "additionalProperties", "contains", "propertyNames", "unevaluatedItems")
EXTENSIONS = ("allOf", "if", "then", "else", "not")  # schemas that extend the object they stand in
EXTENSION_MAPS = ("dependentSchemas", "dependencies")
DEFINITIONS = ("$defs", "definitions")
LOCAL_REF_PREFIXES = tuple(f"#/{key}/" for key in DEFINITIONS)


def closed_objects(schema: Any) -> Any:
    """The schema with every object whose keys it fully lists closed to others (a copy)."""
    extended: set[str] = set()
    _walk(schema, True, extended, close=False)  # the definitions used as extensions: they stay open
    return _walk(schema, True, extended, close=True)


def _walk(schema: Any, closable: bool, extended: set[str], close: bool) -> Any:
    """`closable`: whether this schema describes its objects whole (not an extension of one described beside it)."""
    if isinstance(schema, list):  # allOf's, prefixItems, a draft's items list: each as closable as the list
        return [_walk(sub, closable, extended, close) for sub in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    ref = out.get("$ref")
    if isinstance(ref, str) and ref.startswith(LOCAL_REF_PREFIXES) and (not closable or "properties" in out):
        extended.add(ref.split("/", 2)[2])
    if close and closable and _keys_listed(out):
        out["additionalProperties"] = False
    lists_properties = "properties" in out
    for key in OWN_SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _walk(sub, True, extended, close) for name, sub in out[key].items()}
    for key in OWN_SCHEMAS + ("prefixItems",):  # a boolean schema (additionalProperties false) comes back as it is
        if key in out:
            out[key] = _walk(out[key], True, extended, close)
    for key in ("anyOf", "oneOf"):  # alternatives: each whole, unless they add to the keys listed beside them
        if isinstance(out.get(key), list):
            out[key] = [_walk(sub, closable and not lists_properties, extended, close) for sub in out[key]]
    for key in EXTENSIONS:
        if key in out:
            out[key] = _walk(out[key], False, extended, close)
    for key in EXTENSION_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _walk(sub, False, extended, close) for name, sub in out[key].items()}
    for key in DEFINITIONS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _walk(sub, name not in extended, extended, close) for name, sub in out[key].items()}
    return out


def _keys_listed(schema: dict) -> bool:
    """Whether the object's keys are exactly those its `properties` may list."""
    properties = schema.get("properties")
    if not isinstance(properties, dict) or any(key in schema for key in OPEN_ENDED + EXTENDED_BY):
        return False
    required = schema.get("required", [])
    dependent = schema.get("dependentRequired", {})
    named = set(required) | set(dependent) | {key for keys in dependent.values() for key in keys}
    return named <= set(properties)


def lifted_definitions(schema: dict, prefix: str) -> tuple[dict, dict]:
    """(the schema without its local definitions, those definitions) with each definition renamed `prefix` + its
    name and every reference to it rewritten, for embedding the schema in another whose root holds them."""
    definitions = {f"{prefix}{name}": sub for key in DEFINITIONS for name, sub in (schema.get(key) or {}).items()}
    if not definitions:
        return schema, {}
    rest = {key: value for key, value in schema.items() if key not in DEFINITIONS}
    return _renamed(rest, prefix), {name: _renamed(sub, prefix) for name, sub in definitions.items()}


def _renamed(value: Any, prefix: str) -> Any:
    if isinstance(value, list):
        return [_renamed(item, prefix) for item in value]
    if not isinstance(value, dict):
        return value
    out = {key: _renamed(item, prefix) for key, item in value.items()}
    ref = out.get("$ref")
    if isinstance(ref, str) and ref.startswith(LOCAL_REF_PREFIXES):
        out["$ref"] = f"#/$defs/{prefix}{ref.split('/', 2)[2]}"
    return out
